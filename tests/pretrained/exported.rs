//! Exported models take the attention mask beside the token ids: a padded
//! batch through the exported file gives `transformers`' logits (given
//! `attention_mask`) at every token, and a decoder classifier's pooled last
//! token, as Kiln's own forward pass does.

use super::*;
use kiln::core::export::ExportOptions;
use kiln::onnx::{OnnxExport, OnnxModel, ATTENTION_MASK_INPUT};
use kiln::tf::{export_saved_model, SavedModel};
use kiln::torch::export_torchscript;

/// Exports `layer` with `state` to `path` and runs the file on the padded
/// `ids` with their `mask`: the logits.
type ExportAndRun<'a> =
    dyn Fn(&str, &Layer, &StateDict, &Path, &HostTensor, &HostTensor) -> HostTensor + 'a;

/// For every decoder and encoder family of the references (mixtures of
/// experts included): `run` on the padded batch gives `transformers`'
/// logits at the tokens within 1e-5, nothing is NaN, and a classifier
/// (with the references' head) gives `transformers`' pooled logits.
fn check_exports(test: &str, format: &str, run: &ExportAndRun<'_>) {
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let scratch = std::env::temp_dir().join(format!("kiln-{test}-{}", std::process::id()));
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
        let logits = run(
            name,
            pretrained.layer(),
            &weights,
            &scratch.join(name),
            ids,
            mask,
        );
        logits_close(
            &format!("{name}: {format} padded logits"),
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
            let file = scratch.join(format!("{name}-cls"));
            let pooled = run(name, classifier.layer(), &state, &file, ids, mask);
            logits_close(
                &format!("{name}: {format} padded classifier logits"),
                &floats(&pooled),
                &floats(want),
            );
        }
        checked += 1;
    }
    assert!(checked >= 19, "only {checked} families checked");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The ONNX export has an `attention_mask` input beside `input`, and ONNX
/// Runtime (Kiln's `OnnxModel`) on the padded batch gives `transformers`'
/// logits, mixtures of experts included (every expert weighed on every token).
#[test]
fn exported_onnx_models_take_the_attention_mask() {
    check_exports(
        "exported_onnx_models_take_the_attention_mask",
        "ONNX",
        &|name, layer, state, path, ids, mask| {
            OnnxExport::new(layer, state, &ExportOptions::new(ids.dims()))
                .write(path)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let model = OnnxModel::load(path).unwrap();
            let inputs: Vec<String> = model.info().inputs.iter().map(|i| i.name.clone()).collect();
            assert_eq!(inputs, ["input", ATTENTION_MASK_INPUT], "{name}");
            let out = model
                .run(&[("input", ids), (ATTENTION_MASK_INPUT, mask)])
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            out.into_iter().next().unwrap().1
        },
    );
}

/// The TorchScript export's `forward(input_ids, attention_mask=None)` on the
/// padded batch gives `transformers`' logits, mixtures of experts included
/// (each expert a submodule on the tokens routed to it); without the mask,
/// what Kiln's unmasked forward pass computes.
#[test]
fn exported_torchscript_models_take_the_attention_mask() {
    check_exports(
        "exported_torchscript_models_take_the_attention_mask",
        "TorchScript",
        &|name, layer, state, path, ids, mask| {
            let mut model = TorchModel::new(layer, Device::Cpu).unwrap();
            model.load_state_dict(state).unwrap();
            model.set_mode(Mode::Eval);
            export_torchscript(&model, path, &ExportOptions::default())
                .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let module = tch::CModule::load(path).unwrap();
            let (tids, tmask) = (
                to_tch(ids, Device::Cpu).unwrap(),
                to_tch(mask, Device::Cpu).unwrap(),
            );
            let plain = tch::no_grad(|| module.forward_ts(&[tids.shallow_clone()])).unwrap();
            logits_close(
                &format!("{name}: TorchScript without a mask, against Kiln's forward"),
                &floats(&from_tch(&plain).unwrap()),
                &floats(&torch_logits(&model, ids)),
            );
            let out = tch::no_grad(|| module.forward_ts(&[tids, tmask]))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            from_tch(&out).unwrap()
        },
    );
}

/// The SavedModel's `serving_default` signature takes `input` and
/// `attention_mask`, and gives `transformers`' logits on the padded batch
/// through a TensorFlow session (router losses are not part of a served
/// model).
#[test]
fn exported_saved_models_take_the_attention_mask() {
    check_exports(
        "exported_saved_models_take_the_attention_mask",
        "SavedModel",
        &|name, layer, state, path, ids, mask| {
            let mut tf = TfBackend::build_model(layer, Device::Cpu).unwrap();
            tf.load_state_dict(state).unwrap();
            tf.set_mode(Mode::Eval);
            export_saved_model(&tf, path, &ExportOptions::new(ids.dims()))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let served = SavedModel::load(path).unwrap();
            let mut out = served
                .run(
                    "serving_default",
                    &[("input", ids), (ATTENTION_MASK_INPUT, mask)],
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            out.remove("output").unwrap()
        },
    );
}
