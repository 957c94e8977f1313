//! Padded batches with their attention masks against `transformers`' own
//! `attention_mask`, on both engines: logits, a decoder classifier's pooled
//! last token, and a mixture of experts' router losses, loss and gradients.

use super::*;

/// The values of `[batch, seq, ...]` `t` at the positions `mask` keeps.
pub(super) fn kept(t: &HostTensor, mask: &HostTensor) -> Vec<f64> {
    let per = t.numel() / mask.numel();
    let values = floats(t);
    let mask = mask.as_slice::<i64>().unwrap();
    (0..mask.len())
        .filter(|&i| mask[i] == 1)
        .flat_map(|i| values[i * per..(i + 1) * per].to_vec())
        .collect()
}

/// A batch padded on the right (row 0) and on the left (row 1), with its
/// attention mask, gives `transformers`' logits at every token on libtorch,
/// for every family (sliding windows, softcaps, NoPE and encoders
/// included), through `forward_many([ids, mask])` and the stacked input
/// the CLI's batches carry alike; nothing is NaN, padding rows or
/// gradients; a decoder classifier pools each row's last token as
/// `LlamaForSequenceClassification` does; a mixture of experts' router
/// losses leave the padding out as `transformers`' do; and TensorFlow gives
/// the same logits, classifier logits, and mixture-of-experts loss and
/// gradients through the mask.
#[test]
fn padded_batches_with_attention_masks_match_transformers() {
    let test = "padded_batches_with_attention_masks_match_transformers";
    let Some((dir, cases)) = references(test) else {
        return;
    };
    let (mut checked, mut moe_checked) = (0, 0);
    for case in cases.iter().filter(|c| c["name"] != "vit") {
        let name = case["name"].as_str().unwrap();
        let pretrained = Pretrained::open(dir.join(name)).unwrap();
        let io = io(dir, name);
        let (ids, mask) = (
            io.get("padded_ids").unwrap(),
            io.get("padded_mask").unwrap(),
        );
        let stacked = kiln::core::model::stack_attention_mask(ids, mask).unwrap();
        let mut model = torch_model(&pretrained);
        let (tids, tmask) = (
            to_tch(ids, Device::Cpu).unwrap(),
            to_tch(mask, Device::Cpu).unwrap(),
        );
        let expected = io.get("padded_logits").unwrap();
        let many = tch::no_grad(|| model.forward_many(&[tids.shallow_clone(), tmask])).unwrap();
        let logits = from_tch(&many[0]).unwrap();
        logits_close(
            &format!("{name}: padded logits"),
            &kept(&logits, mask),
            &kept(expected, mask),
        );
        let one = torch_logits(&model, &stacked);
        assert_eq!(floats(&one), floats(&logits), "{name}: stacked input");
        if let Some(aux) = io.get("padded_aux_loss") {
            // A mixture of experts' router losses leave the padding out.
            let zero = tch::Tensor::from(0.0f32);
            let values = router_values(&model.add_auxiliary_losses(zero).unwrap());
            assert_close(
                &format!("{name}: padded aux_loss"),
                &values[..1],
                &floats(aux),
                1e-5,
                "transformers given attention_mask",
            );
            assert_close(
                &format!("{name}: padded router_z_loss"),
                &values[1..],
                &floats(io.get("padded_router_z_loss").unwrap()),
                1e-5,
                "a z-loss over transformers' router logits of the tokens",
            );
            moe_checked += 1;
        }
        assert!(floats(&logits).iter().all(|v| v.is_finite()), "{name}: NaN");
        // Training through the padding: every gradient finite.
        model.set_mode(Mode::Train);
        let x = to_tch(&stacked, Device::Cpu).unwrap();
        let out = model.forward(&x).unwrap();
        out.sum(tch::Kind::Float).backward();
        for (param, t) in model.named_parameters().unwrap() {
            let g = t.grad();
            if g.defined() {
                assert!(
                    floats(&from_tch(&g).unwrap()).iter().all(|v| v.is_finite()),
                    "{name}: gradient of {param}"
                );
            }
        }
        // TensorFlow: the same logits through the stacked input.
        let mut tf = TfBackend::build_model(pretrained.layer(), Device::Cpu).unwrap();
        tf.load_state_dict(&pretrained.load_weights().unwrap())
            .unwrap();
        tf.set_mode(Mode::Eval);
        let out = tf
            .forward(&TfBackend::from_host(&stacked, Device::Cpu).unwrap())
            .unwrap();
        let tf_logits = TfBackend::to_host(&out).unwrap();
        logits_close(
            &format!("{name}: TensorFlow padded logits"),
            &kept(&tf_logits, mask),
            &kept(expected, mask),
        );
        assert!(
            floats(&tf_logits).iter().all(|v| v.is_finite()),
            "{name}: TensorFlow NaN"
        );
        if io.get("padded_aux_loss").is_some() {
            padded_moe_loss_and_gradients_agree(name, &pretrained, &stacked, mask);
        }
        checked += 1;

        if let Some(want) = io.get("classifier_logits") {
            let classifier = Pretrained::open(dir.join(name))
                .unwrap()
                .with_num_labels(3)
                .unwrap();
            let mut cls = TorchModel::new(classifier.layer(), Device::Cpu).unwrap();
            let mut state = classifier.load_weights().unwrap();
            let missing: Vec<String> = cls
                .named_parameters()
                .unwrap()
                .into_iter()
                .map(|(n, _)| n)
                .filter(|n| !state.contains_key(n))
                .collect();
            assert_eq!(missing.len(), 1, "{name}: the new head: {missing:?}");
            state.insert(missing[0].clone(), io.get("score.weight").unwrap().clone());
            cls.load_state_dict(&state).unwrap();
            cls.set_mode(Mode::Eval);
            logits_close(
                &format!("{name}: padded classifier logits"),
                &floats(&torch_logits(&cls, &stacked)),
                &floats(want),
            );
            let mut tf = TfBackend::build_model(classifier.layer(), Device::Cpu).unwrap();
            tf.load_state_dict(&state).unwrap();
            tf.set_mode(Mode::Eval);
            let out = tf
                .forward(&TfBackend::from_host(&stacked, Device::Cpu).unwrap())
                .unwrap();
            logits_close(
                &format!("{name}: TensorFlow padded classifier logits"),
                &floats(&TfBackend::to_host(&out).unwrap()),
                &floats(want),
            );
        }
    }
    assert!(checked >= 15, "only {checked} families checked");
    assert!(
        moe_checked >= 4,
        "only {moe_checked} mixtures of experts checked"
    );
}

/// A mixture of experts' language-model loss over a padded batch (the
/// padding's targets -100), with its router losses as its config weighs
/// them, and every gradient: TensorFlow's equal libtorch's, whose router
/// losses the caller has checked against `transformers`.
fn padded_moe_loss_and_gradients_agree(
    name: &str,
    pretrained: &Pretrained,
    stacked: &HostTensor,
    mask: &HostTensor,
) {
    let mut layers = match pretrained.layer().clone() {
        Layer::Sequential { layers } => layers,
        single => vec![single],
    };
    layers.push(Layer::Flatten {
        start_dim: 0,
        end_dim: 1,
    });
    let spec = Layer::Sequential { layers };
    let (rows, len) = (mask.dims()[0], mask.dims()[1]);
    let ids = &stacked.as_slice::<i64>().unwrap();
    let kept = mask.as_slice::<i64>().unwrap();
    // The next token where both are tokens, -100 elsewhere.
    let targets: Vec<i64> = (0..rows * len)
        .map(|i| {
            let (r, t) = (i / len, i % len);
            if t + 1 < len && kept[i] == 1 && kept[i + 1] == 1 {
                ids[r * 2 * len + t + 1]
            } else {
                -100
            }
        })
        .collect();
    let targets = HostTensor::new(targets, [rows * len]).unwrap();
    let loss = Loss::CrossEntropy(CrossEntropyConfig::new().with_ignore_index(-100));
    let weights = pretrained.load_weights().unwrap();

    let mut torch = TorchModel::new(&spec, Device::Cpu).unwrap();
    torch.load_state_dict(&weights).unwrap();
    torch.set_mode(Mode::Eval);
    let out = torch
        .forward(&TorchBackend::from_host(stacked, Device::Cpu).unwrap())
        .unwrap();
    let plain = TorchBackend::loss(
        &loss,
        &out,
        &TorchBackend::from_host(&targets, Device::Cpu).unwrap(),
    )
    .unwrap();
    let total = torch.add_auxiliary_losses(plain).unwrap().loss;
    total.backward();
    let torch_loss = TorchBackend::item(&total).unwrap();

    let mut tf = TfBackend::build_model(&spec, Device::Cpu).unwrap();
    tf.load_state_dict(&weights).unwrap();
    tf.set_mode(Mode::Eval);
    let (tf_loss, grads) = tf
        .gradients(
            &loss,
            &TfBackend::from_host(stacked, Device::Cpu).unwrap(),
            &TfBackend::from_host(&targets, Device::Cpu).unwrap(),
        )
        .unwrap();
    assert_close(
        &format!("{name}: TensorFlow padded loss"),
        &[tf_loss],
        &[torch_loss],
        1e-5,
        "libtorch",
    );
    let mut compared = 0;
    for (param, t) in torch.named_parameters().unwrap() {
        let Some(tf_grad) = grads.get(&param) else {
            continue;
        };
        let g = t.grad();
        let want = if g.defined() {
            floats(&from_tch(&g).unwrap())
        } else {
            vec![0.0; tf_grad.numel()]
        };
        assert_close(
            &format!("{name}: TensorFlow padded grad {param}"),
            &floats(tf_grad),
            &want,
            1e-5,
            "libtorch",
        );
        compared += 1;
    }
    assert!(compared > 10, "{name}: {compared} gradients compared");
}
