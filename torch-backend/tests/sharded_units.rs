//! Full sharding's units on a model (`TorchModel::plan_shard_units`,
//! `shard_units`), at world size one: each unit gathers its parameters
//! through collectives that hand out copies and keep the gradients they are
//! given. The model's output and those gradients equal an unsharded copy's
//! output and gradients, bit for bit, with resharding after the forward pass,
//! with dropout, residual blocks, a checkpointed unit and a unit nested in
//! the root unit; plans that cannot work (and a mixture of experts whose
//! router losses are in the loss) are refused.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use kiln_core::{
    backend::Backend,
    model::{Layer, LayerNormConfig, LinearConfig},
    module::Module,
    Error, Result,
};
use kiln_torch::sharded_unit::UnitCollectives;
use kiln_torch::{ShardedUnit, TorchBackend, TorchModel};
use tch::{Kind, Tensor};

/// libtorch's generator is shared by the tests, which take turns.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A linear input layer, two residual blocks (layer norm, linear, GELU,
/// dropout, linear), a head.
fn spec() -> Layer {
    let block = Layer::Residual {
        block: Box::new(Layer::sequential([
            Layer::LayerNorm(LayerNormConfig::new([8])),
            LinearConfig::new(8, 8).into(),
            Layer::Gelu {
                approximate: Default::default(),
            },
            Layer::Dropout { p: 0.3 },
            LinearConfig::new(8, 8).into(),
        ])),
    };
    Layer::sequential([
        LinearConfig::new(6, 8).into(),
        block.clone(),
        block,
        LinearConfig::new(8, 3).into(),
    ])
}

fn model() -> TorchModel {
    TorchBackend::manual_seed(11);
    TorchModel::new(&spec(), kiln_core::Device::Cpu).unwrap()
}

/// One unit's collectives at world size one.
struct Local {
    params: Mutex<Vec<Tensor>>,
    grads: Mutex<Vec<Option<Tensor>>>,
}

impl UnitCollectives for Local {
    fn gather(&self) -> Result<Vec<Tensor>> {
        Ok(self
            .params
            .lock()
            .unwrap()
            .iter()
            .map(Tensor::copy)
            .collect())
    }
    fn reduce(&self, grads: Vec<Option<Tensor>>) -> Result<()> {
        *self.grads.lock().unwrap() = grads;
        Ok(())
    }
}

/// Shards `model` by `patterns`: the plan and each unit's collectives.
fn shard(model: &mut TorchModel, patterns: &[&str]) -> (Vec<ShardedUnit>, Vec<Arc<Local>>) {
    let plan = model.plan_shard_units(patterns).unwrap();
    let params: std::collections::HashMap<String, Tensor> =
        model.named_parameters().unwrap().into_iter().collect();
    let locals: Vec<Arc<Local>> = plan
        .iter()
        .map(|u| {
            Arc::new(Local {
                params: Mutex::new(u.names.iter().map(|n| params[n].copy()).collect()),
                grads: Mutex::new(Vec::new()),
            })
        })
        .collect();
    let collectives = locals
        .iter()
        .map(|l| Arc::clone(l) as Arc<dyn UnitCollectives>)
        .collect();
    model.shard_units(&plan, collectives, true).unwrap();
    // What the model's own tensors hold is the strategy's business (its
    // shards): here nothing the units may read.
    tch::no_grad(|| {
        for (_, mut p) in model.named_parameters().unwrap() {
            let _ = p.fill_(f64::NAN);
        }
    });
    (plan, locals)
}

/// The output on a fixed input, and each parameter's gradient by name.
fn run(
    model: &TorchModel,
    locals: Option<(&[ShardedUnit], &[Arc<Local>])>,
) -> (Tensor, Vec<(String, Tensor)>) {
    let x = Tensor::randn([5, 6], (Kind::Float, tch::Device::Cpu));
    TorchBackend::manual_seed(5);
    let y = model.forward(&x).unwrap();
    y.sin().sum(Kind::Float).backward();
    let grads = match locals {
        None => model
            .named_parameters()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.grad()))
            .collect(),
        Some((plan, locals)) => plan
            .iter()
            .zip(locals)
            .flat_map(|(u, l)| {
                let g = l.grads.lock().unwrap();
                u.names
                    .iter()
                    .cloned()
                    .zip(g.iter().map(|g| g.as_ref().unwrap().copy()))
                    .collect::<Vec<_>>()
            })
            .collect(),
    };
    (y.detach(), grads)
}

fn same(a: &(Tensor, Vec<(String, Tensor)>), b: &(Tensor, Vec<(String, Tensor)>)) {
    assert!(a.0.equal(&b.0), "outputs");
    let mut ga =
        a.1.iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect::<Vec<_>>();
    let mut gb =
        b.1.iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect::<Vec<_>>();
    ga.sort_by(|x, y| x.0.cmp(&y.0));
    gb.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        ga.iter().map(|g| &g.0).collect::<Vec<_>>(),
        gb.iter().map(|g| &g.0).collect::<Vec<_>>()
    );
    for ((n, x), (_, y)) in ga.iter().zip(&gb) {
        assert!(x.equal(y), "the gradient of {n}");
    }
}

#[test]
fn sharded_units_compute_what_the_model_computes() {
    let _turn = one_at_a_time();
    let plain = model();
    tch::manual_seed(1);
    let expected = run(&plain, None);

    // Each block a unit, the input and head layers in the root unit.
    let mut sharded = model();
    let (plan, locals) = shard(&mut sharded, &["1", "2"]);
    assert_eq!(
        plan.iter().map(|u| u.path.as_str()).collect::<Vec<_>>(),
        ["1", "2", ""]
    );
    assert_eq!(plan[2].names, ["0.weight", "0.bias", "3.weight", "3.bias"]);
    assert!(plan[0].names.iter().all(|n| n.starts_with("1.block.")));
    tch::manual_seed(1);
    same(&expected, &run(&sharded, Some((&plan, &locals))));

    // The first layer a unit inside the root unit: its input needs no
    // gradient, so only the root unit's backward pass asking for it runs its
    // backward pass (and reduction).
    let mut first = model();
    let (plan, locals) = shard(&mut first, &["0"]);
    assert_eq!(plan.len(), 2);
    tch::manual_seed(1);
    same(&expected, &run(&first, Some((&plan, &locals))));

    // A checkpointed block inside its unit: its second run reads the
    // parameters gathered again, and draws the same dropout mask.
    let mut checkpointed = model();
    let (plan, locals) = shard(&mut checkpointed, &["1", "2"]);
    assert_eq!(checkpointed.checkpoint_activations(&["2"]).unwrap(), ["2"]);
    tch::manual_seed(1);
    same(&expected, &run(&checkpointed, Some((&plan, &locals))));
}

#[test]
fn plans_that_cannot_work_are_refused() {
    let _turn = one_at_a_time();
    let mut m = model();
    let err = m.plan_shard_units(&["9"]).unwrap_err().to_string();
    assert!(err.contains("`9` matches no layer"), "{err}");

    // A plan from another pattern set, or too few collectives.
    let plan = m.plan_shard_units(&["1"]).unwrap();
    let other = vec![ShardedUnit {
        path: "1".into(),
        names: vec!["1.block.1.weight".into()],
    }];
    let err = m.shard_units(&other, Vec::new(), true).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let err = m
        .shard_units(&plan, Vec::new(), true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("0 collectives for 2 units"), "{err}");

    // Once sharded, not again, and no adapters added under the units
    // (units without a root unit: every parameter is in a block or the head).
    let _ = shard(&mut m, &["0", "1", "2", "3"]);
    let err = m.plan_shard_units(&["2"]).unwrap_err().to_string();
    assert!(err.contains("sharded already"), "{err}");
    let lora = kiln_core::lora::LoraConfig::new(2, 4.0);
    let err = m.add_lora(&lora).unwrap_err().to_string();
    assert!(err.contains("add the adapters before sharding"), "{err}");

    // A tied head must share its weight's unit: the head's own unit would
    // compute no gradient for the embedding.
    let tied = Layer::sequential([
        Layer::Embedding(kiln_core::model::EmbeddingConfig {
            num_embeddings: 10,
            embedding_dim: 4,
            padding_idx: None,
            weight_init: None,
            scale: None,
        }),
        LinearConfig::new(4, 4).into(),
        Layer::TiedLinear(kiln_core::model::TiedLinearConfig::new("0.weight", 4, 10)),
    ]);
    let m = TorchModel::new(&tied, kiln_core::Device::Cpu).unwrap();
    let err = m.plan_shard_units(&["2"]).unwrap_err().to_string();
    assert!(
        err.contains("`2`") && err.contains("`0.weight`") && err.contains("tied"),
        "{err}"
    );
    let err = m.plan_shard_units(&["0"]).unwrap_err().to_string();
    assert!(err.contains("tied"), "{err}");
    // Both in the root unit, or the block's own unit beside them: fine.
    assert_eq!(m.plan_shard_units(&["1"]).unwrap().len(), 2);

    // A router whose losses are weighed into the loss: its gradient would not
    // reach it inside a unit.
    let moe = Layer::sequential([
        LinearConfig::new(4, 4).into(),
        kiln_core::model::SparseMoeConfig::new(4, 8, 4, 2)
            .with_router_z_loss_coef(0.01)
            .into(),
    ]);
    let mut m = TorchModel::new(&moe, kiln_core::Device::Cpu).unwrap();
    let plan = m.plan_shard_units(&["1"]).unwrap();
    let err = m.shard_units(&plan, Vec::new(), true).unwrap_err();
    assert!(
        matches!(err, Error::Unsupported { .. }) && err.to_string().contains("router_z_loss_coef"),
        "{err}"
    );
}
