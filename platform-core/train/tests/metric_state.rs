//! Data-parallel evaluation adds metric states up across ranks: for every
//! built-in metric, the states of two disjoint halves of the data, summed
//! (the shorter one padded with zeros, as the trainer does), give the value
//! over the whole data.

use kiln_core::{HostTensor, Result};
use kiln_train::{metric_by_name, LossMetric, Metric};

/// Logits of 4 classes and labels for `rows` samples, deterministic.
fn batch(rows: usize, salt: usize) -> Result<(HostTensor, HostTensor)> {
    let logits: Vec<f32> = (0..rows * 4)
        .map(|i| (((i * 7 + salt * 13) % 11) as f32 - 5.0) / 3.0)
        .collect();
    let labels: Vec<i64> = (0..rows).map(|i| ((i * 5 + salt) % 4) as i64).collect();
    Ok((
        HostTensor::new(logits, [rows, 4])?,
        HostTensor::new(labels, [rows])?,
    ))
}

fn summed(a: &[f64], b: &[f64]) -> Vec<f64> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| a.get(i).copied().unwrap_or(0.0) + b.get(i).copied().unwrap_or(0.0))
        .collect()
}

fn check(make: &dyn Fn() -> Box<dyn Metric>, data: &[(HostTensor, HostTensor)]) -> Result<()> {
    let mut whole = make();
    let (mut left, mut right) = (make(), make());
    for (i, (x, y)) in data.iter().enumerate() {
        whole.update(x, y)?;
        if i % 2 == 0 {
            left.update(x, y)?
        } else {
            right.update(x, y)?
        }
    }
    let state = summed(
        &left.state().expect("a built-in metric has a state"),
        &right.state().expect("a built-in metric has a state"),
    );
    let mut merged = make();
    merged.load_state(&state)?;
    let (a, b) = (merged.compute()?, whole.compute()?);
    assert!(
        (a - b).abs() <= 1e-12 * b.abs().max(1.0),
        "{}: {a} vs {b}",
        whole.name()
    );
    Ok(())
}

#[test]
fn summed_states_give_the_whole_value() -> Result<()> {
    let data: Vec<_> = (0..5).map(|s| batch(3 + s, s)).collect::<Result<_>>()?;
    for name in ["accuracy", "precision", "recall", "f1", "top2_accuracy"] {
        let make = metric_by_name(name).expect("a built-in metric");
        check(&*make, &data)?;
    }
    // A rank that saw nothing contributes an empty (zero-padded) state.
    let make = metric_by_name("f1").expect("f1");
    let mut empty = make();
    assert_eq!(empty.state(), Some(vec![]));
    let mut full = make();
    full.update(&data[0].0, &data[0].1)?;
    empty.load_state(&summed(&[], &full.state().unwrap_or_default()))?;
    assert_eq!(empty.compute()?, full.compute()?);
    // The loss: a sum and a count.
    let mut loss = LossMetric::new("loss");
    loss.update_value(0.5, 4);
    let mut other = LossMetric::new("loss");
    other.update_value(1.0, 2);
    let mut merged = LossMetric::new("loss");
    merged.load_state(&summed(
        &loss.state().unwrap_or_default(),
        &other.state().unwrap_or_default(),
    ))?;
    assert!((merged.compute()? - 4.0 / 6.0).abs() < 1e-15);
    // A state of the wrong form is an error naming the metric.
    let err = merged.load_state(&[1.0]).err().map(|e| e.to_string());
    assert!(err.is_some_and(|m| m.contains("loss") && m.contains("2 numbers")));
    Ok(())
}
