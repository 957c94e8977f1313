//! What a run's config changes in a model: the layer keys the families
//! added (each one trains to other losses than the run without it) and
//! `[model] config`, which replaces keys of a pretrained directory's
//! `config.json`.

use super::common::{kiln_fails, losses, scratch, serial, train};
use super::{config, models, token_csv};

/// The layer keys the families are built from, written in a `[model]` by
/// hand: a run with each (`embedding.scale`, `rope.scaling`,
/// `sliding_window`, `qk_norm_offset`, `qk_norm_across_heads`, the
/// attention's `scale` and `softcap`, a `scale` layer, a `sparse_moe`'s
/// `norm_topk_prob`, `activation`, `shared_expert_dim` and its router losses'
/// weights (logged as `aux_loss` and `router_z_loss` either way); in bf16-true, the
/// norms' `scale_in_float32` and `qk_norm_scale_in_float32`) trains through
/// `kiln train` to other losses than the run without it, on libtorch, and
/// all of them together on TensorFlow.
#[test]
fn the_families_layer_keys_train_through_the_cli_and_each_changes_the_run() {
    let _serial = serial();
    let dir = scratch("layer-keys");
    let csv = token_csv(&dir);
    // keys[5] goes to the RMSNorm, keys[6] to `[training]` (a precision).
    let run = |name: &str, backend: &str, keys: [&str; 7]| -> Vec<(String, String)> {
        let [emb, rope, att, scale, moe, norm, training] = keys;
        let text = format!(
            r#"
seed = 3
backend = "{backend}"
output_dir = "{out}"

[data]
dataset = "csv"
path = "{csv}"
batch_size = 32

[model]
type = "sequential"
layers = [
  {{ type = "embedding", num_embeddings = 300, embedding_dim = 16{emb} }},
  {{ type = "self_attention", embed_dim = 16, num_heads = 2, causal = true, qk_norm_eps = 1e-6, rope = {{ theta = 10000.0{rope} }}{att} }},
  {{ type = "rms_norm", dim = 16{norm} }},
  {{ type = "sparse_moe", dim = 16, hidden_dim = 8, num_experts = 4, top_k = 2{moe} }},
  {{ type = "select", dim = 1, index = -1 }},{scale}
  {{ type = "linear", in_features = 16, out_features = 2 }},
]

[loss]
type = "cross_entropy"

[optimizer]
type = "adamw"
lr = 0.01

[training]
epochs = 1{training}
log_every = 1

[logging]
tensorboard = false
plots = false
progress = false
"#,
            out = dir.join(name).display(),
            csv = csv.display(),
        );
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, text).unwrap();
        let out = dir.join(name);
        train(config.to_str().unwrap(), &out, &[]);
        losses(&out)
    };
    let all = [
        ", scale = 4.0",
        ", scaling = { type = \"llama3\", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_positions = 4 }",
        ", sliding_window = 3, qk_norm_offset = 1.0, scale = 0.2, softcap = 2.0",
        "\n  { type = \"scale\", factor = 0.5 },",
        ", norm_topk_prob = true, activation = \"gelu_tanh\", shared_expert_dim = 8, \
         router_aux_loss_coef = 0.5, router_z_loss_coef = 0.1",
    ];
    let base = run("base", "torch", ["", "", "", "", "", "", ""]);
    assert!(!base.is_empty());
    // The router losses are logged whether or not they are weighed in.
    let metrics = std::fs::read_to_string(dir.join("base").join("epochs.csv")).unwrap();
    let header: Vec<&str> = metrics.lines().next().unwrap().split(',').collect();
    for name in ["aux_loss", "router_z_loss"] {
        assert!(header.contains(&name), "{name} in {header:?}");
    }
    let one = |i: usize, value: &'static str| {
        let mut keys = ["", "", "", "", "", "", ""];
        keys[i] = value;
        keys
    };
    for (name, keys) in [
        ("embedding-scale", one(0, all[0])),
        ("rope-scaling", one(1, all[1])),
        ("sliding-window", one(2, ", sliding_window = 3")),
        ("qk-norm-offset", one(2, ", qk_norm_offset = 1.0")),
        ("attention-scale", one(2, ", scale = 0.2")),
        ("attention-softcap", one(2, ", softcap = 0.5")),
        ("scale-layer", one(3, all[3])),
        (
            "qk-norm-across-heads",
            one(2, ", qk_norm_across_heads = true"),
        ),
        ("moe-norm-topk-prob", one(4, ", norm_topk_prob = true")),
        ("moe-activation", one(4, ", activation = \"gelu\"")),
        ("moe-shared-expert", one(4, ", shared_expert_dim = 8")),
        ("moe-aux-loss", one(4, ", router_aux_loss_coef = 0.5")),
        ("moe-z-loss", one(4, ", router_z_loss_coef = 0.5")),
    ] {
        let losses = run(name, "torch", keys);
        assert_eq!(losses.len(), base.len(), "{name}");
        assert_ne!(losses, base, "{name} changes the run");
    }
    // Where the weight scales (before or after the cast back) shows in
    // bfloat16 only, and the weights start at 1, where both orders agree:
    // those keys change a bf16-true run's trained weights (its three bf16
    // losses are too coarse to show it).
    let bf16 = "\nprecision = \"bf16-true\"";
    let with_bf16 = |i: usize, value: &'static str| {
        let mut keys = one(i, value);
        keys[6] = bf16;
        keys
    };
    let weights = |name: &str| std::fs::read(dir.join(name).join("model.safetensors")).unwrap();
    for (name, keys, reference, reference_keys) in [
        (
            "rms-norm-scale-in-float32",
            with_bf16(5, ", scale_in_float32 = true"),
            "base-bf16",
            one(6, bf16),
        ),
        (
            "qk-norm-scale-in-float32",
            with_bf16(
                2,
                ", qk_norm_across_heads = true, qk_norm_scale_in_float32 = true",
            ),
            "qk-norm-across-heads-bf16",
            with_bf16(2, ", qk_norm_across_heads = true"),
        ),
    ] {
        let losses = run(name, "torch", keys);
        assert_eq!(losses.len(), base.len(), "{name}");
        run(reference, "torch", reference_keys);
        assert_ne!(
            weights(name),
            weights(reference),
            "{name} changes a bf16 run"
        );
    }
    let all = [
        all[0],
        all[1],
        all[2],
        all[3],
        all[4],
        ", scale_in_float32 = true, weight_offset = 1.0",
        "",
    ];
    let tf = run("tensorflow", "tensorflow", all);
    assert_eq!(tf.len(), base.len());
    assert!(
        tf.iter()
            .all(|(_, l)| l.parse::<f64>().unwrap().is_finite()),
        "{tf:?}"
    );
}

/// `[model] config = { ... }` replaces keys of a pretrained directory's
/// `config.json`, as `from_pretrained(dir, **kwargs)` does: Qwen3-MoE with
/// `output_router_logits` trains with its load-balancing loss weighed in
/// (its first loss is the plain run's plus the weight times the logged
/// `aux_loss`), TensorFlow logs the same `aux_loss`, and a value that is not
/// a table is refused.
#[test]
fn a_pretrained_configs_keys_are_replaced_from_the_run_config() {
    let test = "a_pretrained_configs_keys_are_replaced_from_the_run_config";
    let _serial = serial();
    let dir = scratch("config-overrides");
    let Some(models) = models(test) else {
        return;
    };
    let csv = token_csv(&dir);
    let run = |name: &str, overrides: &str| {
        let cfg = config(&dir, &models.join("qwen3_moe"), &csv, name, "");
        let text = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("num_labels = 2", &format!("num_labels = 2\n{overrides}"));
        std::fs::write(&cfg, text).unwrap();
        cfg
    };
    let plain = dir.join("plain");
    train(run("plain", "").to_str().unwrap(), &plain, &[]);
    let weighed = dir.join("weighed");
    let cfg = run(
        "weighed",
        "config = { output_router_logits = true, router_aux_loss_coef = 0.5 }",
    );
    train(cfg.to_str().unwrap(), &weighed, &[]);
    let (a, b) = (losses(&plain), losses(&weighed));
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b, "the load-balancing loss is weighed in");
    // The first step's losses differ by the weight times the logged
    // load-balancing loss (the same weights and batch on both sides).
    let first = |run: &std::path::Path| -> (f64, f64) {
        let text = std::fs::read_to_string(run.join("steps.csv")).unwrap();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let row: Vec<&str> = lines.next().unwrap().split(',').collect();
        let col = |name: &str| {
            let i = header.iter().position(|h| *h == name);
            row[i.unwrap_or_else(|| panic!("{name} in {header:?}"))]
                .parse::<f64>()
                .unwrap()
        };
        (col("loss"), col("aux_loss"))
    };
    let ((plain_loss, aux), (weighed_loss, weighed_aux)) = (first(&plain), first(&weighed));
    assert_eq!(aux, weighed_aux);
    assert!(
        (weighed_loss - plain_loss - 0.5 * aux).abs() < 1e-5,
        "{weighed_loss} - {plain_loss} against 0.5 * {aux}"
    );
    // TensorFlow logs the same router losses, fetched by its compiled step:
    // the first step's aux_loss is libtorch's (the same weights and batch;
    // the router does not see the new head), each epoch's train and
    // validation means are logged, and the loss weighs it in.
    let tf = dir.join("weighed-tf");
    train(cfg.to_str().unwrap(), &tf, &["--backend", "tensorflow"]);
    let (tf_loss, tf_aux) = first(&tf);
    assert!(
        (tf_aux - aux).abs() < 1e-5,
        "TensorFlow {tf_aux} against {aux}"
    );
    assert!(tf_loss.is_finite());
    let epochs = std::fs::read_to_string(tf.join("epochs.csv")).unwrap();
    let header = epochs.lines().next().unwrap();
    for name in [
        "aux_loss",
        "val_aux_loss",
        "router_z_loss",
        "val_router_z_loss",
    ] {
        assert!(header.split(',').any(|h| h == name), "{name} in {header}");
    }
    let bad = run("bad", "config = 3");
    let err = kiln_fails(&["train", "--config", bad.to_str().unwrap()]);
    assert!(
        err.contains("model.config") && err.contains("expected a table"),
        "{err}"
    );
}
