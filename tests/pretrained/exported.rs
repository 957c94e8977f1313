//! Exported models take the attention mask beside the token ids: a padded
//! batch through the exported file gives `transformers`' logits (given
//! `attention_mask`) at every token, and a decoder classifier's pooled last
//! token, as Kiln's own forward pass does.

use super::*;
use kiln::core::export::ExportOptions;
use kiln::onnx::{OnnxExport, OnnxModel, ATTENTION_MASK_INPUT};
use kiln::tf::{export_saved_model, SavedModel};
use kiln::torch::export_torchscript;

/// The ONNX export of every decoder and encoder family, mixtures of experts
/// included, has an `attention_mask` input; ONNX Runtime on a
/// batch padded on the right and on the left gives `transformers`' logits at
/// the tokens, within 1e-5, and the same pooled logits of a classifier.
#[test]
fn exported_onnx_models_take_the_attention_mask() {
    let test = "exported_onnx_models_take_the_attention_mask";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch = std::env::temp_dir().join(format!("kiln-exported-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c["name"] != "vit") {
        let name = case["name"].as_str().unwrap();
        let io = io(dir, name);
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let (ids, mask) = (
            io.get("padded_ids").unwrap(),
            io.get("padded_mask").unwrap(),
        );
        let weights = pretrained.load_weights().unwrap();
        let run = |layer: &Layer, state: &StateDict, file: &str| -> HostTensor {
            let path = scratch.join(file);
            OnnxExport::new(layer, state, &ExportOptions::new(ids.dims()))
                .write(&path)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let model = OnnxModel::load(&path).unwrap();
            let inputs = model
                .info()
                .inputs
                .iter()
                .map(|i| i.name.clone())
                .collect::<Vec<_>>();
            assert_eq!(inputs, ["input", ATTENTION_MASK_INPUT], "{name}");
            let out = model
                .run(&[("input", ids), (ATTENTION_MASK_INPUT, mask)])
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            out.into_iter().next().unwrap().1
        };
        let logits = run(pretrained.layer(), &weights, &format!("{name}.onnx"));
        logits_close(
            &format!("{name}: ONNX padded logits"),
            &padded::kept(&logits, mask),
            &padded::kept(io.get("padded_logits").unwrap(), mask),
        );
        assert!(floats(&logits).iter().all(|v| v.is_finite()), "{name}: NaN");
        if let Some(want) = io.get("classifier_logits") {
            let classifier = pretrained.clone().with_num_labels(3).unwrap();
            let mut state = classifier.load_weights().unwrap();
            let head = classifier
                .layer()
                .parameter_specs("")
                .unwrap()
                .into_iter()
                .map(|p| p.name)
                .find(|n| !state.contains_key(n))
                .unwrap();
            state.insert(head, io.get("score.weight").unwrap().clone());
            let pooled = run(classifier.layer(), &state, &format!("{name}-cls.onnx"));
            logits_close(
                &format!("{name}: ONNX padded classifier logits"),
                &floats(&pooled),
                &floats(want),
            );
        }
        checked += 1;
    }
    assert!(checked >= 19, "only {checked} families checked");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The TorchScript export's `forward(input_ids, attention_mask=None)`: on a
/// padded batch with its mask, `transformers`' logits at the tokens within
/// 1e-5 and a classifier's pooled logits, for every decoder and encoder
/// family and each mixture of experts (its experts as submodules, each on
/// the tokens routed to it); without the mask, what the unmasked model
/// computes.
#[test]
fn exported_torchscript_models_take_the_attention_mask() {
    let test = "exported_torchscript_models_take_the_attention_mask";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch = std::env::temp_dir().join(format!("kiln-exported-ts-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c["name"] != "vit") {
        let name = case["name"].as_str().unwrap();
        let io = io(dir, name);
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let (ids, mask) = (
            io.get("padded_ids").unwrap(),
            io.get("padded_mask").unwrap(),
        );
        let run = |model: &TorchModel, file: &str, with_mask: bool| -> HostTensor {
            let path = scratch.join(file);
            export_torchscript(model, &path, &ExportOptions::default())
                .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let module = tch::CModule::load(&path).unwrap();
            let (tids, tmask) = (
                to_tch(ids, Device::Cpu).unwrap(),
                to_tch(mask, Device::Cpu).unwrap(),
            );
            let out = tch::no_grad(|| match with_mask {
                true => module.forward_ts(&[tids, tmask]),
                false => module.forward_ts(&[tids]),
            })
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            from_tch(&out).unwrap()
        };
        let model = torch_model(&pretrained);
        let logits = run(&model, &format!("{name}.pt"), true);
        logits_close(
            &format!("{name}: TorchScript padded logits"),
            &padded::kept(&logits, mask),
            &padded::kept(io.get("padded_logits").unwrap(), mask),
        );
        assert!(floats(&logits).iter().all(|v| v.is_finite()), "{name}: NaN");
        let plain = run(&model, &format!("{name}-plain.pt"), false);
        logits_close(
            &format!("{name}: TorchScript without a mask, against Kiln's forward"),
            &floats(&plain),
            &floats(&torch_logits(&model, ids)),
        );
        if let Some(want) = io.get("classifier_logits") {
            let classifier = pretrained.clone().with_num_labels(3).unwrap();
            let mut cls = TorchModel::new(classifier.layer(), Device::Cpu).unwrap();
            let mut state = classifier.load_weights().unwrap();
            let head = cls
                .named_parameters()
                .unwrap()
                .into_iter()
                .map(|(n, _)| n)
                .find(|n| !state.contains_key(n))
                .unwrap();
            state.insert(head, io.get("score.weight").unwrap().clone());
            cls.load_state_dict(&state).unwrap();
            cls.set_mode(Mode::Eval);
            let pooled = run(&cls, &format!("{name}-cls.pt"), true);
            logits_close(
                &format!("{name}: TorchScript padded classifier logits"),
                &floats(&pooled),
                &floats(want),
            );
        }
        checked += 1;
    }
    assert!(checked >= 19, "only {checked} families checked");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The SavedModel export's `serving_default` signature takes `input` and
/// `attention_mask`: on a padded batch, `transformers`' logits at the tokens
/// within 1e-5 and a classifier's pooled logits, for every decoder and
/// encoder family and each mixture of experts (router losses are not part of
/// a served model), read back through a TensorFlow session.
#[test]
fn exported_saved_models_take_the_attention_mask() {
    let test = "exported_saved_models_take_the_attention_mask";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch = std::env::temp_dir().join(format!("kiln-exported-sm-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c["name"] != "vit") {
        let name = case["name"].as_str().unwrap();
        let io = io(dir, name);
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let (ids, mask) = (
            io.get("padded_ids").unwrap(),
            io.get("padded_mask").unwrap(),
        );
        let run = |layer: &Layer, state: &StateDict, file: &str| -> HostTensor {
            let mut tf = TfBackend::build_model(layer, Device::Cpu).unwrap();
            tf.load_state_dict(state).unwrap();
            tf.set_mode(Mode::Eval);
            let path = scratch.join(file);
            export_saved_model(&tf, &path, &ExportOptions::new(ids.dims()))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let served = SavedModel::load(&path).unwrap();
            let mut out = served
                .run(
                    "serving_default",
                    &[("input", ids), (ATTENTION_MASK_INPUT, mask)],
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            out.remove("output").unwrap()
        };
        let weights = pretrained.load_weights().unwrap();
        let logits = run(pretrained.layer(), &weights, name);
        logits_close(
            &format!("{name}: SavedModel padded logits"),
            &padded::kept(&logits, mask),
            &padded::kept(io.get("padded_logits").unwrap(), mask),
        );
        if let Some(want) = io.get("classifier_logits") {
            let classifier = pretrained.clone().with_num_labels(3).unwrap();
            let mut state = classifier.load_weights().unwrap();
            let head = classifier
                .layer()
                .parameter_specs("")
                .unwrap()
                .into_iter()
                .map(|p| p.name)
                .find(|n| !state.contains_key(n))
                .unwrap();
            state.insert(head, io.get("score.weight").unwrap().clone());
            let pooled = run(classifier.layer(), &state, &format!("{name}-cls"));
            logits_close(
                &format!("{name}: SavedModel padded classifier logits"),
                &floats(&pooled),
                &floats(want),
            );
        }
        checked += 1;
    }
    assert!(checked >= 19, "only {checked} families checked");
    let _ = std::fs::remove_dir_all(&scratch);
}
