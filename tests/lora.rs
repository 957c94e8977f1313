//! Text data and LoRA fine-tuning against `transformers` and `peft`
//! (`tests/reference/lora.py`): the token ids and labels of instruction rows
//! and of a corpus with Unicode, whitespace runs and special tokens equal
//! `transformers`' tokenizer's, from JSON Lines and from the Parquet file
//! `datasets` writes; PEFT's adapters load into Kiln with PEFT's
//! logits; Kiln trained from PEFT's initial adapters gives PEFT's 20 losses
//! within 1e-5; Kiln's adapters load in `PeftModel.from_pretrained` and its
//! merged model in `from_pretrained`, both with Kiln's logits; an adapter of
//! another base model is refused by name.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln::core::backend::{StepPlan, Trainable};
use kiln::core::lora::LoraConfig;
use kiln::core::optim::AdamWConfig;
use kiln::data::PrefetchLoader;
use kiln::hf::{HfError, Pretrained, TextTokenizer};
use kiln::prelude::*;
use kiln::text::{PadCollate, PromptTemplate, TextDataset, TextOptions, TextTask};
use kiln::torch::{from_tch, to_tch, TorchModel};
use kiln_testkit::assert_close;

/// The references, made once per test binary: `(dir, cases)`.
fn references(test: &str) -> Option<&'static (PathBuf, serde_json::Value)> {
    static MADE: OnceLock<(PathBuf, serde_json::Value)> = OnceLock::new();
    let python = kiln_testkit::python(test)?;
    Some(MADE.get_or_init(|| {
        let dir = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "lora");
        kiln_testkit::run_reference_script!(&python, "lora.py", &[Path::new("make"), &dir]);
        let cases = std::fs::read_to_string(dir.join("cases.json")).unwrap();
        (dir, serde_json::from_str(&cases).unwrap())
    }))
}

fn tokens(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn options(truncation: bool, max: Option<usize>) -> TextOptions {
    TextOptions {
        max_length: max,
        truncation,
        eos_token: Some(2),
    }
}

fn instruction_task(cases: &serde_json::Value) -> TextTask {
    TextTask::Instruction {
        prompt: PromptTemplate::parse(cases["prompt"].as_str().unwrap()).unwrap(),
        response: PromptTemplate::parse("{answer}").unwrap(),
    }
}

/// The base model with its logits flattened for the loss, as `kiln train` builds it.
fn training_model(base: &Pretrained) -> TorchModel {
    let Layer::Sequential { mut layers } = base.layer().clone() else {
        panic!("a sequential");
    };
    layers.push(Layer::Flatten {
        start_dim: 0,
        end_dim: 1,
    });
    let mut model = TorchModel::new(&Layer::sequential(layers), Device::Cpu).unwrap();
    model
        .load_state_dict(&base.load_weights().unwrap())
        .unwrap();
    model
}

/// `model` with `adapters` (Kiln names) loaded over its own.
fn load_adapters(model: &mut TorchModel, adapters: &StateDict) {
    let mut state = model.state_dict().unwrap();
    for (name, t) in adapters.iter() {
        assert!(state.contains_key(name), "{name}");
        state.insert(name.clone(), t.clone());
    }
    model.load_state_dict(&state).unwrap();
}

fn logits(model: &TorchModel, ids: &HostTensor) -> HostTensor {
    let x = to_tch(ids, Device::Cpu).unwrap();
    from_tch(&tch::no_grad(|| model.forward(&x)).unwrap()).unwrap()
}

fn io(path: &Path) -> StateDict {
    StateDict::load_safetensors(path).unwrap().0
}

#[test]
fn token_ids_equal_transformers() {
    let Some((dir, cases)) = references("token_ids_equal_transformers") else {
        return;
    };
    let tokenizer = Arc::new(TextTokenizer::open(dir.join("base")).unwrap());
    let want = tokens(dir);
    let data = TextDataset::open(
        dir.join("train.jsonl"),
        instruction_task(cases),
        options(false, None),
        tokenizer.clone(),
    )
    .unwrap();
    // The same rows as `datasets`' `to_parquet` writes them.
    let parquet = TextDataset::open(
        dir.join("train.parquet"),
        instruction_task(cases),
        options(false, None),
        tokenizer.clone(),
    )
    .unwrap();
    let rows = want["instruction"].as_array().unwrap();
    assert_eq!(data.len(), rows.len());
    assert_eq!(parquet.len(), rows.len());
    for (i, row) in rows.iter().enumerate() {
        for (what, source) in [("jsonl", &data), ("parquet", &parquet)] {
            let (got_ids, got_labels) = source.tokens(i).unwrap();
            assert_eq!(got_ids, ids(&row["ids"]), "{what} instruction row {i}");
            assert_eq!(
                got_labels,
                ids(&row["labels"]),
                "{what} instruction row {i}"
            );
        }
    }
    let corpus = TextDataset::open(
        dir.join("corpus.jsonl"),
        TextTask::LanguageModel {
            text: "text".into(),
        },
        options(false, None),
        tokenizer,
    )
    .unwrap();
    let rows = want["corpus"].as_array().unwrap();
    assert_eq!(corpus.len(), rows.len());
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(corpus.tokens(i).unwrap().0, ids(row), "corpus row {i}");
    }
}

#[test]
fn peft_adapters_load_with_peft_logits() {
    let Some((dir, _)) = references("peft_adapters_load_with_peft_logits") else {
        return;
    };
    let base = Pretrained::open(dir.join("base")).unwrap();
    let (lora, adapters) = base.load_adapter(dir.join("peft_trained")).unwrap();
    assert_eq!((lora.r, lora.alpha, lora.dropout), (4, 8.0, 0.0));
    assert_eq!(lora.target_modules.len(), 6, "{:?}", lora.target_modules);
    let mut model = TorchModel::new(base.layer(), Device::Cpu).unwrap();
    model
        .load_state_dict(&base.load_weights().unwrap())
        .unwrap();
    model.add_lora(&lora).unwrap();
    load_adapters(&mut model, &adapters);
    model.set_mode(Mode::Eval);
    let io = io(&dir.join("io.safetensors"));
    let got = logits(&model, io.get("probe").unwrap());
    let want = io.get("peft_logits").unwrap();
    assert_eq!(got.dims(), want.dims());
    assert_close(
        "logits with PEFT's trained adapters",
        &got.to_f64_vec(),
        &want.to_f64_vec(),
        1e-5,
        "peft",
    );

    // An adapter made for a model of another width names what does not fit.
    let other = Pretrained::open(dir.join("other_base")).unwrap();
    let err = other.load_adapter(dir.join("peft_trained")).unwrap_err();
    assert!(matches!(err, HfError::Adapter { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("another base model"), "{text}");
    assert!(text.contains("lora_A.weight"), "{text}");
    // A directory without an adapter.
    let err = base.load_adapter(dir.join("base")).unwrap_err().to_string();
    assert!(err.contains("no adapter_config.json"), "{err}");
}

#[test]
fn lora_training_matches_peft_and_goes_back_to_python() {
    let Some((dir, cases)) = references("lora_training_matches_peft_and_goes_back_to_python")
    else {
        return;
    };
    let base = Pretrained::open(dir.join("base")).unwrap();
    let (lora, init) = base.load_adapter(dir.join("init_adapter")).unwrap();
    let mut model = training_model(&base);
    let names = model.add_lora(&lora).unwrap();
    assert_eq!(names.len(), 12);
    load_adapters(&mut model, &init);
    let trained: usize = model.num_trainable_parameters().unwrap();
    assert_eq!(trained, trainable_elements(&lora, &base));

    let lr = cases["lr"].as_f64().unwrap();
    let mut optimizer = model
        .build_optimizer(&OptimizerConfig::AdamW(AdamWConfig::new(lr)), &[])
        .unwrap();
    let tokenizer = Arc::new(TextTokenizer::open(dir.join("base")).unwrap());
    let data = TextDataset::open(
        dir.join("train.jsonl"),
        instruction_task(cases),
        options(false, None),
        tokenizer,
    )
    .unwrap();
    let batch = cases["batch"].as_u64().unwrap() as usize;
    let loader =
        PrefetchLoader::with_collate(data, batch, PadCollate::new(0).flatten_targets(true))
            .unwrap();
    let loss = Loss::CrossEntropy(kiln::core::loss::CrossEntropyConfig {
        ignore_index: Some(-100),
        ..Default::default()
    });
    let plan = StepPlan {
        loss: &loss,
        scale: 1.0,
        apply: true,
        clip: None,
    };
    let steps = cases["steps"].as_u64().unwrap() as usize;
    let mut losses = Vec::new();
    'epochs: for epoch in 0.. {
        for b in loader.batches(epoch) {
            let b = b.unwrap();
            let x = to_tch(&b.inputs, Device::Cpu).unwrap();
            let y = to_tch(&b.targets, Device::Cpu).unwrap();
            losses.push(model.train_step(&mut optimizer, &x, &y, &plan).unwrap());
            optimizer.zero_grad().unwrap();
            if losses.len() == steps {
                break 'epochs;
            }
        }
    }
    let want: Vec<f64> = cases["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_close("LoRA training losses", &losses, &want, 1e-5, "peft");
    // The base stayed as loaded.
    let state = model.state_dict().unwrap();
    let loaded = base.load_weights().unwrap();
    for (name, t) in loaded.iter() {
        assert_eq!(state.get(name).unwrap(), t, "{name} changed");
    }

    // Kiln's adapters in PEFT, and Kiln's merged model in transformers.
    let out = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "lora-out");
    base.save_adapter(&lora, &state, out.join("adapter"))
        .unwrap();
    let err = base
        .save_adapter(&lora, &state, out.join("adapter"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("exists"), "{err}");
    let merged = lora.merge(&state).unwrap();
    base.save(&merged, out.join("merged")).unwrap();
    let python =
        kiln_testkit::python("lora_training_matches_peft_and_goes_back_to_python").unwrap();
    let io_path = out.join("check.safetensors");
    kiln_testkit::run_reference_script!(
        &python,
        "lora.py",
        &[
            Path::new("check"),
            dir.as_path(),
            &out.join("adapter"),
            &out.join("merged"),
            &io_path,
        ]
    );
    let probe = io(&dir.join("io.safetensors"))
        .get("probe")
        .unwrap()
        .clone();
    let mut eval_model = TorchModel::new(base.layer(), Device::Cpu).unwrap();
    eval_model.load_state_dict(&loaded).unwrap();
    eval_model.add_lora(&lora).unwrap();
    load_adapters(&mut eval_model, &LoraConfig::adapter_weights(&state));
    eval_model.set_mode(Mode::Eval);
    let ours = logits(&eval_model, &probe).to_f64_vec();
    let theirs = io(&io_path);
    for key in ["peft_logits", "merged_logits"] {
        assert_close(
            key,
            &ours,
            &theirs.get(key).unwrap().to_f64_vec(),
            1e-5,
            "peft / transformers",
        );
    }
}

/// Elements of the adapters `lora` adds to `base`'s model.
fn trainable_elements(lora: &LoraConfig, base: &Pretrained) -> usize {
    lora.parameter_specs(base.layer())
        .unwrap()
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum()
}

/// Adapters of fused modules go both ways with PEFT, for Phi-3 (`qkv_proj`,
/// `gate_up_proj`) and GPT-2 (`c_attn`, a transposed Conv1D): PEFT's
/// rank-2 adapters load into Kiln's separate projections with PEFT's
/// logits; Kiln's adapters, each part with its own `lora_A`, are written as
/// one block-diagonal adapter per fused module (`rank_pattern`,
/// `alpha_pattern`) that `PeftModel.from_pretrained` runs with Kiln's
/// logits, and that Kiln reads back tensor for tensor.
#[test]
fn fused_modules_adapters_go_both_ways_with_peft() {
    let test = "fused_modules_adapters_go_both_ways_with_peft";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let root = kiln_testkit::workspace_root().join("tests/reference");
    let models = kiln_testkit::made_once_per_run(
        &python,
        &root.join("pretrained.py"),
        &["make"],
        "pretrained-models",
    );
    let out = kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "peft-fused");
    kiln_testkit::run_reference(
        &python,
        &root.join("peft_fused.py"),
        &[Path::new("make"), &models, &out],
    );
    for family in ["phi3_5_mini", "gpt2", "gpt_neox", "cohere"] {
        let base = Pretrained::open(models.join(family)).unwrap();
        let (lora, adapters) = base
            .load_adapter(out.join(format!("{family}-peft")))
            .unwrap();
        let io = io(&out.join(format!("{family}.io.safetensors")));
        let probe = io.get("probe").unwrap();
        let run = |adapters: &StateDict| {
            let mut model = TorchModel::new(base.layer(), Device::Cpu).unwrap();
            model
                .load_state_dict(&base.load_weights().unwrap())
                .unwrap();
            model.add_lora(&lora).unwrap();
            load_adapters(&mut model, adapters);
            model.set_mode(Mode::Eval);
            logits(&model, probe).to_f64_vec()
        };
        assert_close(
            &format!("{family}: logits with PEFT's fused adapters"),
            &run(&adapters),
            &io.get("peft_logits").unwrap().to_f64_vec(),
            1e-5,
            "peft",
        );
        // Each part's lora_A of its own, as Kiln trains them.
        let mut trained = StateDict::new();
        for (i, (name, t)) in adapters.iter().enumerate() {
            let scale = 1.0 + 0.1 * (i % 7) as f32;
            let values: Vec<f32> = t
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|v| v * scale)
                .collect();
            trained.insert(
                name.clone(),
                HostTensor::new(values, t.dims().to_vec()).unwrap(),
            );
        }
        let ours = run(&trained);
        let dir = out.join(format!("{family}-kiln"));
        base.save_adapter(&lora, &trained, &dir).unwrap();
        let check = out.join(format!("{family}-check.safetensors"));
        kiln_testkit::run_reference(
            &python,
            &root.join("peft_fused.py"),
            &[Path::new("check"), &models, Path::new(family), &dir, &check],
        );
        assert_close(
            &format!("{family}: PEFT on Kiln's fused adapters"),
            &ours,
            &self::io(&check).get("peft_logits").unwrap().to_f64_vec(),
            1e-5,
            "peft",
        );
        let (again, back) = base.load_adapter(&dir).unwrap();
        assert_eq!((again.r, again.alpha), (lora.r, lora.alpha));
        assert_eq!(back.len(), trained.len(), "{family}");
        for (name, t) in trained.iter() {
            assert_eq!(back.get(name), Some(t), "{family}: {name} read back");
        }
    }
}
