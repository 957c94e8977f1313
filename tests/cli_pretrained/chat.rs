//! Chat through the CLI: `kiln generate --chat` against `transformers`'
//! `generate(apply_chat_template(...))`, and conversational data (`[data]`'s
//! `messages_column`, `prompt_column` / `completion_column` and their keys)
//! against TRL's `SFTTrainer`.

use super::common::{kiln_fails, kiln_stdout, losses, scratch, train};
use super::models;

/// `kiln generate --chat` renders the prompt through the model's chat
/// template (`--system`, `--chat-var`, a conversation from `--messages`),
/// stops at the end of the assistant's turn (the token the template writes
/// after an assistant message, here `<pad>`, not the EOS) and prints the
/// reply that `generate(apply_chat_template(...))` decodes.
#[test]
fn kiln_generate_chat_answers_as_transformers_does() {
    let test = "kiln_generate_chat_answers_as_transformers_does";
    let Some(models) = models(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let out = scratch("generate-chat");
    kiln_testkit::run_reference(
        &python,
        &kiln_testkit::workspace_root().join("tests/reference/chat_generate.py"),
        &[models.as_path(), out.as_path()],
    );
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("expected.json")).unwrap()).unwrap();
    let model = out.join("llama_chat");
    let chat = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--chat",
            "--max-new-tokens",
            "8",
        ];
        args.extend_from_slice(extra);
        kiln_stdout(&args)
    };
    let reply = |case: &str| format!("{}\n", expected[case]["reply"].as_str().unwrap());
    assert_eq!(
        chat(&["--system", "be brief", "--prompt", "the quick brown fox"]),
        reply("prompt"),
        "a prompt with a system message"
    );
    assert_eq!(
        chat(&[
            "--system",
            "be brief",
            "--prompt",
            "the quick brown fox",
            "--chat-var",
            "terse=true"
        ]),
        reply("terse"),
        "a template variable"
    );
    let conversation = out.join("conversation.json");
    assert_eq!(
        chat(&["--messages", conversation.to_str().unwrap()]),
        reply("conversation"),
        "a conversation from a file"
    );
    // Without a template, --chat says where it looked and what to give.
    let bare = out.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(model.join(file), bare.join(file)).unwrap();
    }
    let err = kiln_fails(&[
        "generate",
        "--model",
        bare.to_str().unwrap(),
        "--chat",
        "--prompt",
        "hi",
    ]);
    assert!(
        err.contains("no chat template") && err.contains("--chat-template"),
        "{err}"
    );
    // ... and --chat-template gives one.
    let printed = kiln_stdout(&[
        "generate",
        "--model",
        bare.to_str().unwrap(),
        "--chat",
        "--chat-template",
        model.join("chat_template.jinja").to_str().unwrap(),
        "--system",
        "be brief",
        "--prompt",
        "the quick brown fox",
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(printed, reply("prompt"), "--chat-template");
    let err = kiln_fails(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        "hi",
        "--chat-var",
        "terse",
    ]);
    assert!(err.contains("NAME=VALUE"), "{err}");
}

/// Conversations through the CLI's keys: a `messages_column` with
/// `assistant_only_loss`, `system_prompt` and `chat_template_kwargs`, with a
/// `tools_column`, and a
/// `prompt_column` / `completion_column` pair with `completion_only_loss =
/// false` and a `chat_template` file: the first step's loss (one row, before
/// any update) is the loss of the row as TRL's `SFTTrainer` tokenizes it
/// (`tests/reference/sft_conversations.py`); the conversational keys on plain
/// text are refused by name.
#[test]
fn conversations_train_through_the_cli_as_trl_tokenizes_them() {
    let test = "conversations_train_through_the_cli_as_trl_tokenizes_them";
    let Some(models) = models(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let dir = scratch("cli-conversations");
    let refs = dir.join("refs");
    std::fs::create_dir_all(&refs).unwrap();
    kiln_testkit::run_reference(
        &python,
        &kiln_testkit::workspace_root().join("tests/reference/sft_conversations.py"),
        &[models.as_path(), refs.as_path()],
    );
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(refs.join("expected.json")).unwrap())
            .unwrap();
    let model = refs.join("llama_chat");
    let run = |name: &str, file: &str, data: &str| -> f64 {
        let first = std::fs::read_to_string(refs.join(file)).unwrap();
        let row = dir.join(format!("{name}.jsonl"));
        std::fs::write(&row, first.lines().next().unwrap()).unwrap();
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(
            &cfg,
            format!(
                r#"
seed = 1
output_dir = "{out}"

[model]
pretrained = "{model}"

[data]
dataset = "text"
path = "{row}"
val_fraction = 0
batch_size = 1
{data}

[loss]
type = "cross_entropy"

[optimizer]
type = "sgd"
lr = 0.001

[training]
epochs = 1
log_every = 1

[logging]
tensorboard = false
plots = false
progress = false
"#,
                out = dir.join(name).display(),
                model = model.display(),
                row = row.display(),
            ),
        )
        .unwrap();
        let out = dir.join(name);
        train(cfg.to_str().unwrap(), &out, &[]);
        losses(&out)[0].1.parse().unwrap()
    };
    let close = |ours: f64, case: &str| {
        let want = expected[case]["first_loss"].as_f64().unwrap();
        assert!(
            (ours - want).abs() <= 1e-4 * want.abs(),
            "{case}: {ours} vs TRL's {want}"
        );
    };
    close(
        run(
            "conversation",
            "conversations.jsonl",
            "messages_column = \"messages\"\nassistant_only_loss = true\nsystem_prompt = \"be kind\"\nchat_template_kwargs = { shout = true }",
        ),
        "conversation_system_kwargs",
    );
    close(
        run(
            "completion",
            "prompt_completion.jsonl",
            &format!(
                "prompt_column = \"prompt\"\ncompletion_column = \"completion\"\ncompletion_only_loss = false\nchat_template = \"{}\"",
                model.join("chat_template.jinja").display()
            ),
        ),
        "completion_all",
    );
    close(
        run(
            "tools",
            "conversations_tools.jsonl",
            "messages_column = \"messages\"\ntools_column = \"tools\"\nassistant_only_loss = true",
        ),
        "conversation_tools",
    );
    let good = std::fs::read_to_string(dir.join("conversation.toml")).unwrap();
    let cfg = dir.join("bad.toml");
    std::fs::write(
        &cfg,
        good.replace(
            "messages_column = \"messages\"",
            "text_column = \"messages\"",
        ),
    )
    .unwrap();
    let err = kiln_fails(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(err.contains("data.assistant_only_loss"), "{err}");
}
