//! Chat templates against `apply_chat_template`: the real templates of
//! `tests/fixtures/chat_templates` (LLaMA 3.2, Qwen2.5, Qwen3, Gemma 2,
//! Phi-3.5, Mistral v0.3, SmolLM2, SmolLM3), each in a tokenizer directory
//! as `save_pretrained` writes it, render every conversation of
//! `tests/reference/chat_templates.py` (system prompts, several turns, a
//! generation prompt, tools and a tool call, reasoning with
//! `enable_thinking = false`) to the same text, the same ids and, for
//! SmolLM3's `{% generation %}` blocks, the same assistant masks; where the
//! template raises, Kiln fails with its message.

use kiln::hf::{ChatOptions, ChatTemplate, TextTokenizer};
use serde_json::Value;

#[test]
fn chat_templates_render_as_apply_chat_template_does() {
    let test = "chat_templates_render_as_apply_chat_template_does";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let script = kiln_testkit::workspace_root().join("tests/reference/chat_templates.py");
    let dir = kiln_testkit::made_once_per_run(&python, &script, &[] as &[&str], "chat-templates");
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let (mut rendered, mut masked, mut raised) = (0, 0, 0);
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let what = format!("{name} / {}", case["case"].as_str().unwrap());
        let template = ChatTemplate::open(dir.join(name))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .unwrap_or_else(|| panic!("{what}: no template found"));
        let tokenizer = TextTokenizer::open(dir.join(name)).unwrap();
        let options = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: case["tools"].as_array().cloned(),
            documents: None,
            variables: case["variables"].as_object().cloned().unwrap(),
            now: chrono::NaiveDate::from_ymd_opt(2024, 7, 26)
                .and_then(|d| d.and_hms_opt(12, 30, 0)),
        };
        let messages = case["messages"].as_array().unwrap();
        let result = template.render(messages, &options);
        if let Some(error) = case["error"].as_str() {
            let err = result.expect_err(&what).to_string();
            assert!(
                err.contains(error),
                "{what}: Kiln says {err:?}, Python {error:?}"
            );
            raised += 1;
            continue;
        }
        let chat = result.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            chat.text,
            case["text"].as_str().unwrap(),
            "{what}: the text"
        );
        let tokens = chat.tokenize(&tokenizer).unwrap();
        let ids: Vec<i64> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tokens.ids, ids, "{what}: the ids");
        if let Some(mask) = case.get("assistant_masks") {
            let mask: Vec<i64> = serde_json::from_value(mask.clone()).unwrap();
            let ours: Vec<i64> = tokens
                .assistant_mask
                .iter()
                .map(|&m| i64::from(m))
                .collect();
            assert_eq!(ours, mask, "{what}: the assistant mask");
            assert!(template.has_generation_blocks(), "{what}");
            masked += 1;
        }
        rendered += 1;
    }
    assert_eq!(
        (rendered, masked, raised),
        (38, 5, 2),
        "the reference's cases"
    );
}

/// Conversations as TRL's `SFTTrainer` tokenizes them: for a `messages`
/// column with and without `assistant_only_loss` (the template's `{%
/// generation %}` blocks), with a system prompt added and template variables,
/// and for conversational prompt-completion with and without
/// `completion_only_loss`, every row's ids and labels equal the trainer's
/// `train_dataset` (`tests/reference/sft_conversations.py`); a template
/// without generation blocks is refused for assistant-only loss.
#[test]
fn conversations_tokenize_as_trl_sft_trainer_does() {
    use kiln::data::Dataset;
    use kiln::hf::ChatTokenizer;
    use kiln::text::{TextDataset, TextOptions, TextTask, TokenizeChat};
    use std::sync::Arc;

    let test = "conversations_tokenize_as_trl_sft_trainer_does";
    let Some((models, _)) = super::references(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let script = kiln_testkit::workspace_root().join("tests/reference/sft_conversations.py");
    let out =
        kiln_testkit::made_once_per_run(&python, &script, &[models.as_path()], "sft-conversations");
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("expected.json")).unwrap()).unwrap();
    let model = out.join("llama_chat");
    let tokenizer = Arc::new(TextTokenizer::open(&model).unwrap());
    let chat = |system: bool, shout: bool| -> Arc<dyn TokenizeChat> {
        let template = ChatTemplate::open(&model).unwrap().unwrap();
        let mut options = ChatOptions::default();
        if shout {
            options = options.with_variable("shout", true);
        }
        let mut chat = ChatTokenizer::new(template, tokenizer.clone(), options);
        if system {
            chat = chat.with_system_prompt("be kind");
        }
        Arc::new(chat)
    };
    let conversation = |assistant_only| TextTask::Conversation {
        messages: "messages".into(),
        tools: None,
        assistant_only,
    };
    let completion = |completion_only| TextTask::ChatCompletion {
        prompt: "prompt".into(),
        completion: "completion".into(),
        tools: None,
        completion_only,
        assistant_only: false,
    };
    let with_tools = TextTask::Conversation {
        messages: "messages".into(),
        tools: Some("tools".into()),
        assistant_only: true,
    };
    let settings = [
        (
            "conversation_all",
            "conversations.jsonl",
            conversation(false),
            false,
            false,
        ),
        (
            "conversation_assistant",
            "conversations.jsonl",
            conversation(true),
            false,
            false,
        ),
        (
            "conversation_system_kwargs",
            "conversations.jsonl",
            conversation(true),
            true,
            true,
        ),
        (
            "conversation_tools",
            "conversations_tools.jsonl",
            with_tools,
            false,
            false,
        ),
        (
            "completion_only",
            "prompt_completion.jsonl",
            completion(true),
            false,
            false,
        ),
        (
            "completion_all",
            "prompt_completion.jsonl",
            completion(false),
            false,
            false,
        ),
    ];
    let options = TextOptions {
        max_length: None,
        truncation: false,
        eos_token: None,
    };
    for (name, file, task, system, shout) in settings {
        let data = TextDataset::open(out.join(file), task, options.clone(), tokenizer.clone())
            .unwrap()
            .with_chat(chat(system, shout))
            .unwrap();
        let want = &expected[name];
        let rows = want["input_ids"].as_array().unwrap().len();
        assert_eq!(data.len(), rows, "{name}");
        for i in 0..rows {
            let (ids, labels) = data.tokens(i).unwrap();
            let want_ids: Vec<i64> = serde_json::from_value(want["input_ids"][i].clone()).unwrap();
            let want_labels: Vec<i64> = serde_json::from_value(want["labels"][i].clone()).unwrap();
            assert_eq!(ids, want_ids, "{name}, row {i}: ids");
            assert_eq!(labels, want_labels, "{name}, row {i}: labels");
        }
    }
    // The conversations as `datasets` writes them to Parquet (lists of structs) give the same.
    let parquet = TextDataset::open(
        out.join("conversations.parquet"),
        conversation(true),
        options.clone(),
        tokenizer.clone(),
    )
    .unwrap()
    .with_chat(chat(false, false))
    .unwrap();
    let want = &expected["conversation_assistant"];
    assert_eq!(parquet.len(), want["input_ids"].as_array().unwrap().len());
    for i in 0..parquet.len() {
        let (ids, labels) = parquet.tokens(i).unwrap();
        assert_eq!(
            ids,
            serde_json::from_value::<Vec<i64>>(want["input_ids"][i].clone()).unwrap()
        );
        assert_eq!(
            labels,
            serde_json::from_value::<Vec<i64>>(want["labels"][i].clone()).unwrap()
        );
    }
    // The tiny model's own tokenizer directory has no generation blocks.
    let plain = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        Vec::<(String, String)>::new(),
        "plain.jinja",
    )
    .unwrap();
    let err = TextDataset::open(
        out.join("conversations.jsonl"),
        conversation(true),
        options,
        tokenizer.clone(),
    )
    .unwrap()
    .with_chat(Arc::new(ChatTokenizer::new(
        plain,
        tokenizer,
        ChatOptions::default(),
    )))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("plain.jinja") && err.contains("{% generation %}"),
        "{err}"
    );
}
