//! The Hugging Face fine-tuning example, as a user runs it (its code is
//! included here): a tiny LLaMA made by its script learns the script's text
//! (the validation loss falls far below the checkpoint's), the weights it
//! writes back load again under the same names, and it ends with text that
//! continues its prompt.

#![allow(clippy::unwrap_used)]

use std::path::Path;

mod common;

#[allow(dead_code)] // its `main`
#[path = "../examples/pretrained_lm.rs"]
mod pretrained_lm;

#[test]
fn the_example_fine_tunes_saves_and_generates() {
    let test = "the_example_fine_tunes_saves_and_generates";
    let Some(python) = kiln_testkit::python(test) else {
        return;
    };
    let _serial = common::serial();
    let dir = common::scratch("pretrained-lm");
    let model = dir.join("tiny-llama");
    common::tiny_llama(&python, &model);
    let out = dir.join("run");
    let done = pretrained_lm::run(&model, &out, 1).unwrap();
    assert!(
        done.loss_after < done.loss_before / 3.0,
        "validation loss {} -> {}",
        done.loss_before,
        done.loss_after
    );
    let saved = kiln::hf::Pretrained::open(out.join("model")).unwrap();
    assert_eq!(saved.load_weights().unwrap(), done.weights);
    for (what, text) in &done.texts {
        assert!(
            text.starts_with("The little fox") && text.len() > "The little fox".len() + 10,
            "{what}: {text}"
        );
        assert_eq!(
            &std::fs::read_to_string(out.join(format!("{what}.txt"))).unwrap(),
            text
        );
    }
    assert!(Path::new(&out.join("steps.csv")).is_file());
}
