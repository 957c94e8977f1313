//! Fine-tuning a language model on text through the CLI: instruction pairs in
//! JSON Lines with LoRA adapters on a Hugging Face LLaMA (the references of
//! `tests/reference/lora.py`); a run stopped after one epoch resumes to the
//! uninterrupted run's losses; the run's PEFT adapter and its checkpoint
//! generate the same tokens; the checkpoint exports with the adapters
//! merged; packing (from Parquet), CSV instruction pairs and truncated text
//! classification train; bad data, templates, targets and adapters are
//! refused by name before anything is written.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{kiln, kiln_fails, kiln_stdout, losses, scratch, serial, train};
use kiln::train::Checkpoint;

/// The reference models and data, made once per test binary.
fn references(test: &str) -> Option<PathBuf> {
    static MADE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    common::made_once(test, &MADE, "lora.py", "lora-references")
}

/// A config over `refs`' base model: `data` is the `[data]` body, `extra`
/// top-level keys (`[lora]` goes there).
fn config(dir: &Path, refs: &Path, name: &str, data: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
seed = 3
output_dir = "{out}"

{extra}

[model]
pretrained = "{model}"

[data]
dataset = "text"
batch_size = 4
workers = 2
{data}

[loss]
type = "cross_entropy"

[optimizer]
type = "adamw"
lr = 0.01

[training]
epochs = 2
log_every = 1

[checkpoint]
every_n_epochs = 1

[logging]
tensorboard = false
plots = false
"#,
        out = dir.join(name).display(),
        model = refs.join("base").display(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn instruction_data(refs: &Path) -> String {
    format!(
        "path = \"{}\"\nval_fraction = 0.25\nprompt_template = \"### Question:\\n{{question}}\\n\\n### Answer:\\n\"\nresponse_template = \"{{answer}}\"",
        refs.join("train.jsonl").display()
    )
}

const LORA: &str = r#"[lora]
r = 4
alpha = 8
dropout = 0.1
target_modules = ["q_proj", "v_proj", "down_proj"]"#;

#[test]
fn lora_fine_tunes_resumes_generates_and_exports_through_the_cli() {
    let test = "lora_fine_tunes_resumes_generates_and_exports_through_the_cli";
    let _serial = serial();
    let dir = scratch("cli-lora");
    let Some(refs) = references(test) else {
        return;
    };
    let cfg = config(&dir, &refs, "run", &instruction_data(&refs), LORA);
    let cfg = cfg.to_str().unwrap();
    let (whole, stopped) = (dir.join("whole"), dir.join("stopped"));
    let printed = train(cfg, &whole, &[]);
    assert!(printed.contains("trainable"), "{printed}");
    assert!(printed.contains("accuracy"), "{printed}");
    let reference = losses(&whole);
    assert_eq!(
        reference.len(),
        10,
        "18 training rows in batches of 4, 2 epochs"
    );
    train(cfg, &stopped, &["--epochs", "1"]);
    train(cfg, &stopped, &["--epochs", "2", "--resume", "auto"]);
    assert_eq!(losses(&stopped), reference, "resumed LoRA run");

    // Only the adapters trained; the checkpoint records them.
    let last = Checkpoint::load(&whole.join("checkpoints/last.safetensors")).unwrap();
    let lora = last.lora.clone().unwrap();
    assert_eq!((lora.r, lora.alpha), (4, 8.0));
    let shown = kiln_stdout(&[
        "inspect",
        whole.join("checkpoints/last.safetensors").to_str().unwrap(),
    ]);
    assert!(
        shown.contains("lora        r = 4, alpha = 8, dropout = 0.1 on q_proj"),
        "{shown}"
    );
    let base = kiln::hf::Pretrained::open(refs.join("base")).unwrap();
    let pretrained = base.load_weights().unwrap();
    for (name, tensor) in pretrained.iter() {
        assert_eq!(last.model.get(name), Some(tensor), "{name} changed");
    }
    // The PEFT adapter in the run directory holds the checkpoint's adapters.
    let (read, adapters) = base.load_adapter(whole.join("adapter")).unwrap();
    // The resumed run's adapter is its last epoch's, the uninterrupted run's.
    let resumed = base.load_adapter(stopped.join("adapter")).unwrap().1;
    assert_eq!((read.r, read.alpha, read.dropout), (4, 8.0, 0.1));
    assert_eq!(adapters.len(), 12);
    for (name, tensor) in adapters.iter() {
        assert_eq!(last.model.get(name), Some(tensor), "{name}");
        assert_eq!(resumed.get(name), Some(tensor), "resumed {name}");
    }

    // The base model with the run's adapter generates what the checkpoint does.
    let ask = |model: &Path, adapter: Option<&Path>| {
        let mut args = vec![
            "generate".to_owned(),
            "--model".into(),
            model.to_str().unwrap().into(),
            "--prompt-ids".into(),
            "1,45,67,89,12".into(),
            "--max-new-tokens".into(),
            "8".into(),
            "--stop=-1".into(),
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter".into(), a.to_str().unwrap().into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kiln_stdout(&args)
    };
    let with_adapter = ask(&refs.join("base"), Some(&whole.join("adapter")));
    let from_checkpoint = ask(&whole.join("checkpoints/last.safetensors"), None);
    let without = ask(&refs.join("base"), None);
    assert_eq!(with_adapter, from_checkpoint);
    assert_ne!(
        with_adapter, without,
        "the adapters change what the model says"
    );
    // An adapter of another base model is refused by name.
    let err = kiln_fails(&[
        "generate",
        "--model",
        refs.join("other_base").to_str().unwrap(),
        "--adapter",
        whole.join("adapter").to_str().unwrap(),
        "--prompt-ids",
        "1,2",
    ]);
    assert!(err.contains("another base model"), "{err}");

    // The checkpoint exports with the adapters merged.
    let onnx = dir.join("model.onnx");
    kiln(&[
        "export",
        "--checkpoint",
        whole.join("checkpoints/last.safetensors").to_str().unwrap(),
        "--config",
        cfg,
        "--format",
        "onnx",
        "--output",
        onnx.to_str().unwrap(),
    ]);
    assert!(onnx.is_file());
}

#[test]
fn packed_and_csv_text_train_and_bad_inputs_are_refused() {
    let test = "packed_and_csv_text_train_and_bad_inputs_are_refused";
    let _serial = serial();
    let dir = scratch("cli-lora-data");
    let Some(refs) = references(test) else {
        return;
    };
    // A language model's text from Parquet (`datasets`' `to_parquet`), packed
    // into blocks of 16 tokens.
    let packed = format!(
        "path = \"{}\"\nval_fraction = 0\ntext_column = \"answer\"\nmax_length = 16\npacking = true",
        refs.join("train.parquet").display()
    );
    let cfg = config(&dir, &refs, "packed", &packed, LORA);
    let out = dir.join("packed-run");
    train(cfg.to_str().unwrap(), &out, &["--epochs", "1"]);
    let steps = losses(&out);
    assert!(!steps.is_empty());
    for (step, loss) in &steps {
        assert!(
            loss.parse::<f64>().unwrap().is_finite(),
            "step {step}: {loss}"
        );
    }

    // Instruction pairs from CSV (quoted fields with commas and newlines), full fine-tuning.
    let csv = dir.join("pairs.csv");
    std::fs::write(
        &csv,
        "question,answer\n\"Where, exactly?\nSay it.\",\"The fox sleeps, by the river.\"\nWhere is the owl?,The owl sleeps by the hill.\n",
    )
    .unwrap();
    let csv_data = format!(
        "path = \"{}\"\nval_fraction = 0\nprompt_template = \"Q: {{question}}\\nA: \"\nresponse_template = \"{{answer}}\"",
        csv.display()
    );
    let cfg = config(&dir, &refs, "csv", &csv_data, "");
    train(
        cfg.to_str().unwrap(),
        &dir.join("csv-run"),
        &["--epochs", "1"],
    );
    assert_eq!(losses(&dir.join("csv-run")).len(), 1);

    // Text classification (a new head, rows one at a time), the tokenizer named,
    // rows truncated to 6 tokens.
    let labelled = dir.join("labelled.jsonl");
    std::fs::write(
        &labelled,
        "{\"text\": \"The fox sleeps by the river.\", \"label\": 1}\n{\"text\": \"Where?\", \"label\": 0}\n".repeat(4),
    )
    .unwrap();
    let classify_data = format!(
        "path = \"{}\"\nval_fraction = 0\ntext_column = \"text\"\nlabel_column = \"label\"\nmax_length = 6\ntruncation = true\ntokenizer = \"{}\"",
        labelled.display(),
        refs.join("base").display()
    );
    let cfg = config(&dir, &refs, "classify", &classify_data, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("batch_size = 4", "batch_size = 1")
        .replace("[data]", "num_labels = 2\n\n[data]");
    std::fs::write(&cfg, text).unwrap();
    let printed = train(
        cfg.to_str().unwrap(),
        &dir.join("classify-run"),
        &["--epochs", "1"],
    );
    assert!(printed.contains("8 training"), "{printed}");
    assert_eq!(losses(&dir.join("classify-run")).len(), 8);
    // Rows of several lengths in one batch: padded, with their attention mask,
    // the validation loss is the one of the rows taken one at a time (an
    // unpadded row sees no padding), the optimizer standing still.
    let val_loss = |batch_size: usize, backend: &str| -> f64 {
        let name = format!("classify-val{batch_size}{backend}");
        let cfg = config(
            &dir,
            &refs,
            &name,
            &classify_data.replace(
                "val_fraction = 0",
                &format!("val_path = \"{}\"", labelled.display()),
            ),
            &format!("backend = \"{backend}\""),
        );
        let text = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("batch_size = 4", &format!("batch_size = {batch_size}"))
            .replace("lr = 0.01", "lr = 1e-30")
            .replace("[data]", "num_labels = 2\n\n[data]");
        std::fs::write(&cfg, text).unwrap();
        train(cfg.to_str().unwrap(), &dir.join(&name), &["--epochs", "1"]);
        let epochs = std::fs::read_to_string(dir.join(&name).join("epochs.csv")).unwrap();
        let mut lines = epochs.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = header.iter().position(|h| *h == "val_loss").unwrap();
        lines
            .next()
            .unwrap()
            .split(',')
            .nth(col)
            .unwrap()
            .parse()
            .unwrap()
    };
    let (padded, one_by_one) = (val_loss(4, "torch"), val_loss(1, "torch"));
    assert!(
        (padded - one_by_one).abs() <= 1e-5 * one_by_one.abs().max(1.0),
        "validation loss over padded batches {padded}, one row at a time {one_by_one}"
    );
    // TensorFlow's layers take the mask too (its new head is drawn from
    // its own generator, so its runs are compared with each other).
    let (tf_padded, tf_one_by_one) = (val_loss(4, "tensorflow"), val_loss(1, "tensorflow"));
    assert!(
        (tf_padded - tf_one_by_one).abs() <= 1e-5 * tf_one_by_one.abs().max(1.0),
        "TensorFlow's validation loss over padded batches {tf_padded}, one row at a time \
         {tf_one_by_one}"
    );
    // With LoRA, a new head would stay frozen: refused.
    let with_lora = dir.join("classify-lora.toml");
    std::fs::write(
        &with_lora,
        std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("[model]", &format!("{LORA}\n\n[model]")),
    )
    .unwrap();
    let err = kiln_fails(&["train", "--config", with_lora.to_str().unwrap()]);
    assert!(err.contains("the head would stay frozen"), "{err}");

    // Bad inputs name what is wrong, and nothing is written.
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let train_jsonl = refs.join("train.jsonl");
    let cases: Vec<(String, String, &str)> = vec![
        (
            instruction_data(&refs).replace("{answer}", "{answr}"),
            LORA.into(),
            "no column `answr`",
        ),
        (
            format!("path = \"{}\"\ntext_column = \"text\"", empty.display()),
            String::new(),
            "holds no rows",
        ),
        (
            format!(
                "path = \"{}\"\ntext_column = \"question\"\nmax_length = 6",
                train_jsonl.display()
            ),
            String::new(),
            "longer than max_length = 6 (set truncation = true",
        ),
        (
            instruction_data(&refs),
            LORA.replace("\"down_proj\"", "\"query\""),
            "`query` matches no projection",
        ),
        (
            instruction_data(&refs),
            format!("backend = \"tensorflow\"\n{LORA}"),
            "LoRA adapters train on the torch backend",
        ),
        (
            format!(
                "path = \"{}\"\ntext_column = \"answer\"\npacking = true",
                train_jsonl.display()
            ),
            String::new(),
            "set max_length",
        ),
    ];
    for (i, (data, extra, expected)) in cases.iter().enumerate() {
        let name = format!("bad{i}");
        let cfg = config(&dir, &refs, &name, data, extra);
        let err = kiln_fails(&["train", "--config", cfg.to_str().unwrap()]);
        assert!(err.contains(expected), "case {i}: {err}");
        assert!(
            !dir.join(&name).exists(),
            "case {i} wrote its output directory"
        );
    }
}

/// Makes the example's tiny LLaMA in `dir/models/tiny-llama` (returned) and
/// trains the shipped `examples/configs/{config}` from `dir`, its paths
/// relative to where kiln runs, as for a user in the workspace.
fn train_shipped(python: &Path, dir: &Path, config: &str) -> PathBuf {
    let models = dir.join("models/tiny-llama");
    common::tiny_llama(python, &models);
    let config = kiln_testkit::workspace_root()
        .join("examples/configs")
        .join(config);
    let out = std::process::Command::new(common::KILN)
        .current_dir(dir)
        .args(["train", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    models
}

/// The shipped config fine-tunes the example's tiny LLaMA on its instruction
/// pairs; the answers to the held-out questions, greedy, move to the data's:
/// none is right without the adapter, nearly all with it.
#[test]
fn the_shipped_lora_config_teaches_the_example_model_its_answers() {
    let test = "the_shipped_lora_config_teaches_the_example_model_its_answers";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let _serial = serial();
    let dir = scratch("lora-shipped");
    let models = train_shipped(&python, &dir, "lora-llama.toml");
    let run = dir.join("runs/lora-llama");
    let val = std::fs::read_to_string(models.join("instructions_val.jsonl")).unwrap();
    let pairs: Vec<serde_json::Value> = val
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let right = |adapter: Option<&Path>| -> usize {
        let mut args: Vec<String> = vec![
            "generate".into(),
            "--model".into(),
            models.to_str().unwrap().into(),
            "--max-new-tokens".into(),
            "16".into(),
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter".into(), a.to_str().unwrap().into()]);
        }
        for p in &pairs {
            args.push("--prompt".into());
            args.push(format!(
                "### Question:\n{}\n\n### Answer:\n",
                p["question"].as_str().unwrap()
            ));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let printed = kiln_stdout(&args);
        let answers: Vec<&str> = printed
            .split("### Answer:\n")
            .skip(1)
            .map(|rest| rest.split("### Question:").next().unwrap().trim())
            .collect();
        assert_eq!(answers.len(), pairs.len(), "{printed}");
        answers
            .iter()
            .zip(&pairs)
            .filter(|(a, p)| **a == p["answer"].as_str().unwrap())
            .count()
    };
    let before = right(None);
    let after = right(Some(&run.join("adapter")));
    eprintln!("held-out answers right: {before} of 40 before, {after} after LoRA fine-tuning");
    assert_eq!(before, 0);
    assert!(after >= 30, "{after} of 40 answers right after fine-tuning");
}

/// The shipped chat config fine-tunes the example's tiny LLaMA on its
/// conversations (assistant-only loss through its chat template's `{%
/// generation %}` blocks); `kiln generate --chat` then answers the held-out
/// questions with the data's answers: none before, nearly all after.
#[test]
fn the_shipped_chat_config_teaches_the_example_model_to_answer_in_chat() {
    let test = "the_shipped_chat_config_teaches_the_example_model_to_answer_in_chat";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let _serial = serial();
    let dir = scratch("chat-shipped");
    let models = train_shipped(&python, &dir, "chat-llama.toml");
    let val = std::fs::read_to_string(models.join("conversations_val.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = val
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // One question a call: a reply may run over several lines.
    let right = |adapter: Option<&Path>| -> usize {
        rows.iter()
            .filter(|row| {
                let mut args = vec![
                    "generate",
                    "--model",
                    models.to_str().unwrap(),
                    "--chat",
                    "--max-new-tokens",
                    "16",
                    "--prompt",
                    row["messages"][0]["content"].as_str().unwrap(),
                ];
                if let Some(a) = adapter {
                    args.extend(["--adapter", a.to_str().unwrap()]);
                }
                kiln_stdout(&args).trim() == row["messages"][1]["content"].as_str().unwrap()
            })
            .count()
    };
    let before = right(None);
    let after = right(Some(&dir.join("runs/chat-llama/adapter")));
    eprintln!("held-out chat answers right: {before} of 40 before, {after} after fine-tuning");
    assert_eq!(before, 0);
    assert!(after >= 30, "{after} of 40 answers right after fine-tuning");
}

/// LoRA under data parallelism: two ranks under `kiln launch` (batches of 2
/// each) train the adapters as one process does with batches of 4.
#[test]
fn lora_on_two_ranks_trains_as_one_process() {
    let test = "lora_on_two_ranks_trains_as_one_process";
    let _serial = serial();
    let dir = scratch("cli-lora-ranks");
    let Some(refs) = references(test) else {
        return;
    };
    let lora = LORA.replace("dropout = 0.1", "dropout = 0.0\nuse_rslora = true");
    let data = format!("{}\ndrop_last = true", instruction_data(&refs));
    let single_cfg = config(&dir, &refs, "single", &data, &lora);
    let ranks_cfg = dir.join("ranks.toml");
    std::fs::write(
        &ranks_cfg,
        std::fs::read_to_string(&single_cfg)
            .unwrap()
            .replace("batch_size = 4", "batch_size = 2"),
    )
    .unwrap();
    let single = dir.join("single-run");
    train(single_cfg.to_str().unwrap(), &single, &["--epochs", "1"]);
    let ranks = dir.join("ranks-run");
    kiln(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "train",
        "--config",
        ranks_cfg.to_str().unwrap(),
        "--output",
        ranks.to_str().unwrap(),
        "--epochs",
        "1",
    ]);
    let (a, b) = (losses(&ranks), losses(&single));
    assert_eq!(a.len(), b.len());
    assert_eq!(
        a.len(),
        4,
        "18 training rows, batches of 4, the last dropped"
    );
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        let (x, y): (f64, f64) = (x.parse().unwrap(), y.parse().unwrap());
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1.0),
            "step {step}: {x} vs {y}"
        );
    }
    assert!(ranks.join("adapter/adapter_model.safetensors").is_file());
}
