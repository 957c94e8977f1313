//! Hugging Face checkpoints against `transformers`: tiny LLaMA, Mistral, Qwen2,
//! Qwen3, GPT-2, BERT (a sequence classifier) and ViT (an image classifier)
//! with random weights, decoders with every scaled RoPE (linear, dynamic
//! NTK, YaRN, Llama 3, proportional; one config in the Hub's older
//! `rope_scaling` form) and sliding windows (Mistral, Qwen2), Phi-3.5 /
//! Phi-4-mini shapes (fused projections, LongRoPE, partial rotary), Granite
//! (its multipliers) and Gemma 3
//! (local and global layers; its older config form too), saved by `save_pretrained` (one sharded), load into
//! Kiln; their logits match `transformers`' within 1e-5 on libtorch and on
//! TensorFlow; greedy generation of left-padded
//! prompts equals `generate(do_sample=False)` token for token, and cached
//! decoding gives the uncached logits; Kiln's saved weights load back with
//! `from_pretrained` to the same logits. The references come from
//! `tests/reference/pretrained.py`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln::core::generation::GenerationConfig;
use kiln::core::loss::{CrossEntropyConfig, Loss};
use kiln::hf::{HfError, Pretrained, TextTokenizer};
use kiln::prelude::*;
use kiln::tf::TfBackend;
use kiln::torch::{from_tch, generate, to_tch, KvCache, TorchModel};
use kiln_testkit::assert_close;

#[path = "pretrained/chat.rs"]
mod chat;
#[path = "pretrained/exported.rs"]
mod exported;
#[path = "pretrained/padded.rs"]
mod padded;

/// The reference models, made once per test binary: `(dir, cases)`, or `None`
/// where the reference cannot run.
fn references(test: &str) -> Option<&'static (PathBuf, Vec<serde_json::Value>)> {
    static MADE: OnceLock<(PathBuf, Vec<serde_json::Value>)> = OnceLock::new();
    let python = kiln_testkit::python(test)?;
    Some(MADE.get_or_init(|| {
        // Shared with tests/cli_pretrained.rs: made once per test run.
        let dir = kiln_testkit::made_once_per_run(
            &python,
            &kiln_testkit::workspace_root().join("tests/reference/pretrained.py"),
            &[Path::new("make")],
            "pretrained-models",
        );
        let cases = std::fs::read_to_string(dir.join("cases.json")).unwrap();
        (dir, serde_json::from_str(&cases).unwrap())
    }))
}

fn io(dir: &Path, name: &str) -> StateDict {
    StateDict::load_safetensors(dir.join(format!("{name}.io.safetensors")))
        .unwrap()
        .0
}

fn floats(t: &HostTensor) -> Vec<f64> {
    t.to_f64_vec()
}

fn torch_model(pretrained: &Pretrained) -> TorchModel {
    let mut model = TorchModel::new(pretrained.layer(), Device::Cpu).unwrap();
    model
        .load_state_dict(&pretrained.load_weights().unwrap())
        .unwrap();
    model.set_mode(Mode::Eval);
    model
}

fn torch_logits(model: &TorchModel, ids: &HostTensor) -> HostTensor {
    let x = to_tch(ids, Device::Cpu).unwrap();
    from_tch(&tch::no_grad(|| model.forward(&x)).unwrap()).unwrap()
}

/// Logits within 1e-5 of `transformers`' relative to the largest of them (at
/// least 1): the softmax reads differences on that scale, and a logit near 0
/// in a row that reaches 7 (Gemma's) carries the rounding of the larger sums
/// that made it (TensorFlow's float32 kernels round otherwise than PyTorch's,
/// and otherwise on another CPU).
fn logits_close(what: &str, actual: &[f64], expected: &[f64]) {
    let scale = expected.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    let scaled = |v: &[f64]| -> Vec<f64> { v.iter().map(|x| x / scale).collect() };
    assert_close(
        what,
        &scaled(actual),
        &scaled(expected),
        1e-5,
        "transformers",
    );
}

#[test]
fn every_family_loads_and_matches_transformers_on_both_engines() {
    let test = "every_family_loads_and_matches_transformers_on_both_engines";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        assert_eq!(
            pretrained.family().model_type,
            case["family"].as_str().unwrap()
        );
        if case["sharded"].as_bool().unwrap() {
            assert!(
                pretrained.weight_files().unwrap().len() > 1,
                "{name}: sharded"
            );
        }
        let io = io(dir, name);
        let ids = io
            .get("input_ids")
            .or_else(|| io.get("pixel_values"))
            .unwrap();
        let expected = floats(io.get("logits").unwrap());
        let model = torch_model(&pretrained);
        let logits = torch_logits(&model, ids);
        logits_close(
            &format!("{name}: torch logits"),
            &floats(&logits),
            &expected,
        );

        let mut tf = TfBackend::build_model(pretrained.layer(), Device::Cpu).unwrap();
        tf.load_state_dict(&pretrained.load_weights().unwrap())
            .unwrap();
        tf.set_mode(Mode::Eval);
        let out = tf
            .forward(&TfBackend::from_host(ids, Device::Cpu).unwrap())
            .unwrap();
        let tf_logits = TfBackend::to_host(&out).unwrap();
        logits_close(
            &format!("{name}: TensorFlow logits"),
            &floats(&tf_logits),
            &expected,
        );
    }
}

/// The rows of `[batch, len]` `ids` without the positions `mask` zeroes.
fn unpadded(ids: &HostTensor, mask: &HostTensor) -> Vec<Vec<i64>> {
    let len = ids.dims()[1];
    let ids = ids.as_slice::<i64>().unwrap();
    let mask = mask.as_slice::<i64>().unwrap();
    ids.chunks(len)
        .zip(mask.chunks(len))
        .map(|(row, m)| {
            row.iter()
                .zip(m)
                .filter(|(_, m)| **m != 0)
                .map(|(t, _)| *t)
                .collect()
        })
        .collect()
}

#[test]
fn greedy_generation_equals_transformers_and_the_cache_changes_nothing() {
    let test = "greedy_generation_equals_transformers_and_the_cache_changes_nothing";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    for case in cases.iter().filter(|c| c["decoder"].as_bool().unwrap()) {
        let name = case["name"].as_str().unwrap();
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let model = torch_model(&pretrained);
        let io = io(dir, name);
        let (prompt_ids, mask) = (
            io.get("prompt_ids").unwrap(),
            io.get("attention_mask").unwrap(),
        );
        let prompts = unpadded(prompt_ids, mask);
        let new = case["new_tokens"].as_u64().unwrap() as usize;
        let greedy = io.get("greedy").unwrap();
        let width = greedy.dims()[1];
        let expected: Vec<Vec<i64>> = greedy
            .as_slice::<i64>()
            .unwrap()
            .chunks(width)
            .map(|row| row[width - new..].to_vec())
            .collect();
        // Dynamic NTK's frequencies follow the length: a cached step rotates
        // its token for the length so far while the cache keeps earlier
        // rotations (as transformers' generate does), which a pass over the
        // whole sequence cannot repeat.
        let modes: &[bool] = if case["length_dependent_rope"].as_bool().unwrap_or(false) {
            &[true]
        } else {
            &[true, false]
        };
        for &use_cache in modes {
            let config = GenerationConfig::greedy(new)
                .with_pad_token(case["pad_id"].as_i64().unwrap())
                .with_cache(use_cache);
            let out = generate(&model, &prompts, &config).unwrap();
            assert_eq!(
                out, expected,
                "{name}: greedy tokens (cache {use_cache}) against transformers"
            );
        }

        // Prompt then two single tokens through the cache, against one pass.
        let full = to_tch(prompt_ids, Device::Cpu).unwrap();
        let tmask = to_tch(mask, Device::Cpu).unwrap();
        let mut cache = KvCache::new();
        let first = model
            .forward_cached(
                &full.narrow(1, 0, 3),
                Some(&tmask.narrow(1, 0, 3)),
                &mut cache,
            )
            .unwrap();
        let second = model
            .forward_cached(&full.narrow(1, 3, 1), None, &mut cache)
            .unwrap();
        let third = model
            .forward_cached(&full.narrow(1, 4, 1), None, &mut cache)
            .unwrap();
        let stepped = tch::Tensor::cat(&[first, second, third], 1);
        let whole = model
            .forward_cached(&full, Some(&tmask), &mut KvCache::new())
            .unwrap();
        let (a, b) = (from_tch(&stepped).unwrap(), from_tch(&whole).unwrap());
        // Padding positions' logits are never read; compare the real tokens'.
        let m: Vec<bool> = mask
            .as_slice::<i64>()
            .unwrap()
            .iter()
            .map(|v| *v != 0)
            .collect();
        let vocab = a.dims()[2];
        let keep = |t: &HostTensor| -> Vec<f64> {
            floats(t)
                .chunks(vocab)
                .zip(&m)
                .filter(|(_, k)| **k)
                .flat_map(|(row, _)| row.to_vec())
                .collect()
        };
        assert_close(
            &format!("{name}: cached logits"),
            &keep(&a),
            &keep(&b),
            1e-5,
            "uncached Kiln",
        );
    }
}

/// One training step of every decoder on the next-token loss, as
/// `model(input_ids, labels=input_ids).loss.backward()` takes it: the loss
/// and every parameter's gradient (mapped back to the checkpoint's names by
/// `Pretrained::save`, fused and tied tensors included) against `transformers`.
#[test]
fn one_training_step_gives_transformers_loss_and_gradients() {
    let test = "one_training_step_gives_transformers_loss_and_gradients";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch =
        kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "pretrained-grads");
    for case in cases.iter().filter(|c| c["decoder"].as_bool().unwrap()) {
        let name = case["name"].as_str().unwrap();
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        // In evaluation mode on both sides: GPT-2's dropout would draw masks.
        let model = torch_model(&pretrained);
        let ids = to_tch(io(dir, name).get("input_ids").unwrap(), Device::Cpu).unwrap();
        let logits = model.forward(&ids).unwrap();
        let (len, vocab) = (logits.size()[1], logits.size()[2]);
        let loss = logits
            .narrow(1, 0, len - 1)
            .reshape([-1, vocab])
            .cross_entropy_for_logits(&ids.narrow(1, 1, len - 1).reshape([-1]));
        // A mixture of experts' load-balancing loss, where its config weighs it in.
        let loss = model.add_auxiliary_losses(loss).unwrap().loss;
        <kiln::torch::TorchBackend as kiln::core::backend::EagerBackend>::backward(&loss).unwrap();
        let mut grads = StateDict::new();
        for (param, tensor) in model.named_parameters().unwrap() {
            // An expert no token chose has no gradient (PyTorch's None), which
            // transformers' fused expert tensors hold as zeros.
            let grad = match tensor.grad() {
                g if g.defined() => g,
                _ => tensor.zeros_like(),
            };
            grads.insert(param, from_tch(&grad).unwrap());
        }
        let out = scratch.join(name);
        pretrained.save(&grads, &out).unwrap();
        let kiln = StateDict::load_safetensors(out.join("model.safetensors"))
            .unwrap()
            .0;
        let reference = StateDict::load_safetensors(dir.join(format!("{name}.grads.safetensors")))
            .unwrap()
            .0;
        assert_close(
            &format!("{name}: loss"),
            &[loss.double_value(&[])],
            &floats(reference.get("loss").unwrap()),
            1e-5,
            "transformers",
        );
        let expected = reference.keys().filter(|k| k.starts_with("grad.")).count();
        assert_eq!(kiln.len(), expected, "{name}: gradients");
        for (hf, grad) in kiln.iter() {
            let want = reference
                .get(&format!("grad.{hf}"))
                .unwrap_or_else(|| panic!("{name}: transformers has no gradient for {hf}"));
            assert_close(
                &format!("{name}: grad {hf}"),
                &floats(grad),
                &floats(want),
                1e-5,
                "transformers",
            );
        }
    }
}

/// Every mixture of experts' router losses as `transformers` computes them:
/// the load-balancing loss (its `aux_loss`) and the z-loss over the same
/// router logits, logged on libtorch; and where the config weighs the
/// load-balancing loss in (`output_router_logits`), the training loss and
/// every gradient on both engines, through Kiln's language-model loss (the
/// logits flattened, cross-entropy ignoring -100) as the CLI trains it.
#[test]
fn mixtures_of_experts_train_with_transformers_router_losses_on_both_engines() {
    let test = "mixtures_of_experts_train_with_transformers_router_losses_on_both_engines";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch =
        kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "pretrained-router");
    let loss = Loss::CrossEntropy(CrossEntropyConfig::new().with_ignore_index(-100));
    let (mut checked, mut weighed) = (Vec::new(), Vec::new());
    for case in cases.iter().filter(|c| c["decoder"].as_bool().unwrap()) {
        let name = case["name"].as_str().unwrap();
        let reference = StateDict::load_safetensors(dir.join(format!("{name}.grads.safetensors")))
            .unwrap()
            .0;
        let Some(aux) = reference.get("aux_loss") else {
            continue;
        };
        checked.push(name);
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let mut layers = match pretrained.layer().clone() {
            Layer::Sequential { layers } => layers,
            single => vec![single],
        };
        layers.push(Layer::Flatten {
            start_dim: 0,
            end_dim: 1,
        });
        let spec = Layer::Sequential { layers };
        let ids = io(dir, name).get("input_ids").unwrap().clone();
        let (rows, len) = (ids.dims()[0], ids.dims()[1]);
        let tokens = ids.as_slice::<i64>().unwrap();
        let targets: Vec<i64> = (0..rows * len)
            .map(|i| {
                if (i + 1) % len == 0 {
                    -100
                } else {
                    tokens[i + 1]
                }
            })
            .collect();
        let targets = HostTensor::new(targets, [rows * len]).unwrap();
        let weights = pretrained.load_weights().unwrap();

        let mut torch = TorchModel::new(&spec, Device::Cpu).unwrap();
        torch.load_state_dict(&weights).unwrap();
        torch.set_mode(Mode::Eval);
        assert_eq!(torch.auxiliary_loss_names(), ["aux_loss", "router_z_loss"]);
        let out = torch
            .forward(&TorchBackend::from_host(&ids, Device::Cpu).unwrap())
            .unwrap();
        let plain = TorchBackend::loss(
            &loss,
            &out,
            &TorchBackend::from_host(&targets, Device::Cpu).unwrap(),
        )
        .unwrap();
        let plain_value = TorchBackend::item(&plain).unwrap();
        let with = torch.add_auxiliary_losses(plain).unwrap();
        let values = router_values(&with);
        assert_close(
            &format!("{name}: aux_loss"),
            &values[..1],
            &floats(aux),
            1e-5,
            "transformers",
        );
        assert_close(
            &format!("{name}: router_z_loss"),
            &values[1..],
            &floats(reference.get("router_z_loss").unwrap()),
            1e-5,
            "a z-loss over transformers' router logits",
        );
        let total = TorchBackend::item(&with.loss).unwrap();
        let want = floats(reference.get("loss").unwrap());
        assert_close(
            &format!("{name}: torch loss"),
            &[total],
            &want,
            1e-5,
            "transformers",
        );
        if (total - plain_value).abs() < 1e-3 {
            // Not weighed in: the published checkpoints' setting.
            continue;
        }
        weighed.push(name);

        let mut tf = TfBackend::build_model(&spec, Device::Cpu).unwrap();
        tf.load_state_dict(&weights).unwrap();
        tf.set_mode(Mode::Eval);
        let (tf_loss, mut grads) = tf
            .gradients(
                &loss,
                &TfBackend::from_host(&ids, Device::Cpu).unwrap(),
                &TfBackend::from_host(&targets, Device::Cpu).unwrap(),
            )
            .unwrap();
        assert_close(
            &format!("{name}: TensorFlow loss"),
            &[tf_loss],
            &want,
            1e-5,
            "transformers",
        );
        // An expert no token chose: no gradient, which transformers holds as zeros.
        for (key, w) in weights.iter() {
            if grads.get(key).is_none() {
                grads.insert(
                    key.clone(),
                    HostTensor::zeros(w.dtype(), w.dims().to_vec()).unwrap(),
                );
            }
        }
        let out_dir = scratch.join(name);
        pretrained.save(&grads, &out_dir).unwrap();
        let kiln = StateDict::load_safetensors(out_dir.join("model.safetensors"))
            .unwrap()
            .0;
        for (hf, grad) in kiln.iter() {
            assert_close(
                &format!("{name}: TensorFlow grad {hf}"),
                &floats(grad),
                &floats(reference.get(&format!("grad.{hf}")).unwrap()),
                1e-5,
                "transformers",
            );
        }
    }
    assert_eq!(checked, ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]);
    assert_eq!(
        weighed,
        ["qwen2_moe", "olmoe"],
        "output_router_logits in their configs"
    );
}

#[test]
fn saved_weights_load_in_transformers_and_nothing_is_overwritten() {
    let test = "saved_weights_load_in_transformers_and_nothing_is_overwritten";
    let Some((dir, _)) = references(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    for name in [
        "llama_tied_sharded",
        "gpt2",
        "qwen2",
        "bert",
        "phi4_mini",
        "gemma3_text",
        "granite",
        "mixtral",
        "qwen2_moe",
    ] {
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let mut model = torch_model(&pretrained);
        // Changed weights, so that the check cannot pass on the original file.
        let state = model.state_dict().unwrap();
        let scaled: StateDict = state
            .iter()
            .map(|(k, t)| {
                let v: Vec<f32> = t
                    .as_slice::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x * 0.9 + 0.01)
                    .collect();
                (k.clone(), HostTensor::new(v, t.dims().to_vec()).unwrap())
            })
            .collect();
        model.load_state_dict(&scaled).unwrap();
        let state = model.state_dict().unwrap();
        let out = kiln_testkit::scratch_dir(
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            &format!("saved-{name}"),
        );
        let saved = out.join("model");
        pretrained.save(&state, &saved).unwrap();
        assert_eq!(
            saved.join("tokenizer.json").is_file(),
            dir.join(name).join("tokenizer.json").is_file(),
            "{name}: the tokenizer travels"
        );

        let mut io_file = io(dir, name);
        io_file.insert(
            "kiln_logits",
            torch_logits(&model, io_file.get("input_ids").unwrap()),
        );
        let io_path = out.join("io.safetensors");
        io_file
            .save_safetensors(&io_path, &Default::default())
            .unwrap();
        let stdout = kiln_testkit::run_reference_script!(
            &python,
            "pretrained.py",
            &[Path::new("check"), &saved, &io_path]
        );
        let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        let diff = report["max_abs_diff"].as_f64().unwrap();
        assert!(
            diff < 1e-5,
            "{name}: from_pretrained of Kiln's save gives logits {diff} away"
        );

        // Kiln's reload of its own save gives the same weights.
        let again = Pretrained::open(&saved).unwrap().load_weights().unwrap();
        assert_eq!(again, state, "{name}: reloaded weights");
        // A second save into the same directory is refused, the files intact.
        let before = std::fs::read(saved.join("model.safetensors")).unwrap();
        let err = pretrained
            .save(&state, &saved)
            .expect_err("the directory is taken");
        assert!(err.to_string().contains("never replaces"), "{err}");
        assert_eq!(
            std::fs::read(saved.join("model.safetensors")).unwrap(),
            before
        );
    }
}

#[test]
fn bad_directories_are_typed_errors_naming_the_key_or_tensor() {
    let test = "bad_directories_are_typed_errors_naming_the_key_or_tensor";
    let Some((dir, _)) = references(test) else {
        return;
    };
    let scratch =
        kiln_testkit::scratch_dir(Path::new(env!("CARGO_TARGET_TMPDIR")), "pretrained-bad");
    let copy = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let to = scratch.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["model.safetensors", "tokenizer.json"] {
            std::fs::copy(dir.join("llama").join(f), to.join(f)).unwrap();
        }
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("llama/config.json")).unwrap())
                .unwrap();
        edit(&mut config);
        std::fs::write(to.join("config.json"), config.to_string()).unwrap();
        to
    };

    let err = Pretrained::open(copy("bert", &|c| c["model_type"] = "t5".into())).unwrap_err();
    assert!(matches!(err, HfError::UnknownFamily { .. }), "{err}");
    assert!(err.to_string().contains("\"t5\""), "{err}");

    // A rope_type transformers does not have, and one missing a key it needs.
    let err = Pretrained::open(copy("xpos", &|c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "xpos", "rope_theta": 10000.0})
    }))
    .unwrap_err();
    assert!(
        matches!(err, HfError::UnsupportedKey { ref key, .. } if key == "rope_parameters.rope_type"),
        "{err}"
    );
    assert!(err.to_string().contains("\"xpos\""), "{err}");
    let err = Pretrained::open(copy("llama3", &|c| {
        c["rope_parameters"] =
            serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0})
    }))
    .unwrap_err();
    assert!(
        matches!(err, HfError::Config { ref key, .. } if key == "rope_parameters.low_freq_factor"),
        "{err}"
    );

    // Three layers in the config, two in the weights: refused from the
    // weights' headers, before the definition is built.
    let err = Pretrained::open(copy("deeper", &|c| c["num_hidden_layers"] = 3.into())).unwrap_err();
    assert!(
        matches!(err, HfError::Config { ref key, .. } if key == "num_hidden_layers"),
        "{err}"
    );
    assert!(err.to_string().contains("hold 2 layers"), "{err}");

    // One layer in the config: the second layer's tensors are unexpected.
    let shallower =
        Pretrained::open(copy("shallower", &|c| c["num_hidden_layers"] = 1.into())).unwrap();
    let err = shallower.load_weights().unwrap_err();
    assert!(
        matches!(err, HfError::UnexpectedTensor { ref name, .. } if name.starts_with("model.layers.1.")),
        "{err}"
    );

    // A wider config than the weights: refused from the headers too; a
    // narrower one by the load, which checks every tensor's shape.
    let err = Pretrained::open(copy("wider", &|c| c["intermediate_size"] = 64.into())).unwrap_err();
    assert!(
        matches!(err, HfError::Config { ref key, .. } if key == "intermediate_size"),
        "{err}"
    );
    let narrower =
        Pretrained::open(copy("narrower", &|c| c["intermediate_size"] = 8.into())).unwrap();
    let err = narrower.load_weights().unwrap_err();
    assert!(matches!(err, HfError::TensorShape { .. }), "{err}");

    let err = Pretrained::open(scratch.join("nowhere")).unwrap_err();
    assert!(matches!(err, HfError::NotAModel { .. }), "{err}");
}

#[test]
fn the_tokenizer_reads_tokenizer_json_as_python_does() {
    let test = "the_tokenizer_reads_tokenizer_json_as_python_does";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let tok = TextTokenizer::open(dir.join("llama")).unwrap();
    let text = cases[0]["text"].as_str().unwrap();
    let ids = tok.encode(text).unwrap();
    let python: Vec<i64> = serde_json::from_value(cases[0]["text_ids"].clone()).unwrap();
    assert_eq!(ids, python, "ids of {text:?} against the tokenizers wheel");
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert_eq!(tok.token_id("</s>"), Some(2));
}

/// The values of a mixture of experts' router losses (`aux_loss`,
/// `router_z_loss`) that `add_auxiliary_losses` gave.
fn router_values(with: &kiln::core::module::WithAuxiliaryLosses<tch::Tensor>) -> Vec<f64> {
    with.values
        .iter()
        .map(|t| TorchBackend::item(t).unwrap())
        .collect()
}
