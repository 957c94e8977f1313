//! The character-level GPT example, as a user runs it (its code is included
//! here): a short run on the text it generates learns it (a validation loss
//! far below a uniform guess and below what any context-free guess can reach),
//! samples reproducibly in the vocabulary, is causal end to end, and computes
//! what a PyTorch GPT written from `nn.MultiheadAttention` computes with its
//! weights; the same code learns on the TensorFlow backend.

#![allow(clippy::unwrap_used)] // a test that fails should fail loudly

use std::process::Command;

use kiln::prelude::*;

mod common;

#[allow(dead_code)] // its `main`
#[path = "../examples/char_lm.rs"]
mod char_lm;

use char_lm::{story, train, Settings, Trained};

/// Sizes that train in well under a minute in a debug build on two cores.
fn quick() -> Settings {
    Settings {
        embed: 48,
        epochs: 1,
        ..Settings::default()
    }
}

#[test]
fn the_example_learns_its_text_samples_reproducibly_and_is_causal() {
    let _serial = common::serial();
    let dir = common::scratch("char-lm");
    let out = dir.join("run");
    let settings = quick();
    let text = story(7, 6000);
    let model: Trained<TorchBackend> = train(&text, &out, &settings).unwrap();
    let v = model.vocab.len();
    assert_eq!(
        std::fs::read_to_string(out.join("input.txt")).unwrap(),
        text,
        "the training text is in the run directory"
    );

    // The loss: far below a uniform guess (ln V), and below the entropy of
    // the validation characters, which no predictor that ignores the
    // context can beat: the model reads its context.
    let uniform = (v as f64).ln();
    eprintln!(
        "V = {v}: validation loss {:.4} (accuracy {:.3}), ln V {uniform:.4}, unigram entropy {:.4}",
        model.val_loss, model.val_accuracy, model.val_unigram_entropy
    );
    assert!(
        model.val_loss < 0.75 * uniform,
        "{} vs ln V {uniform}",
        model.val_loss
    );
    assert!(
        model.val_loss < model.val_unigram_entropy - 0.5,
        "{} vs the context-free bound {}",
        model.val_loss,
        model.val_unigram_entropy
    );
    // The alphabet of the grammar, counted by hand from its word lists:
    // 24 lower-case letters, 9 capitals, punctuation, space and newline.
    let expected: String = " \n,.?ABCDEFITWabcdefghiklmnopqrstuvwxy".chars().collect();
    let mut alphabet: Vec<char> = expected.chars().collect();
    alphabet.sort_unstable();
    assert_eq!(
        model.vocab.decode(&(0..v).collect::<Vec<_>>()),
        alphabet.iter().collect::<String>()
    );

    // Sampling: the requested length, vocabulary characters only, the same
    // text for the same seed and another for another seed.
    let sample = model.sample("The ", 80, 0.8, 1).unwrap();
    eprintln!("sample: The {sample}");
    assert_eq!(sample.chars().count(), 80);
    assert!(sample.chars().all(|c| alphabet.contains(&c)), "{sample:?}");
    assert_eq!(model.sample("The ", 80, 0.8, 1).unwrap(), sample);
    assert_ne!(model.sample("The ", 80, 0.8, 2).unwrap(), sample);
    let error = model.sample("Zebra", 5, 0.8, 1).unwrap_err().to_string();
    assert!(error.contains("'Z' is not one of"), "{error}");

    // Causality end to end: changing the characters after position t leaves
    // the logits up to t as they were and changes those after it; a shorter
    // context gives the same logits as the start of a longer one.
    let block = settings.block;
    let window = model.vocab.encode(&text[100..100 + block]).unwrap();
    let logits = model.logits(&window).unwrap();
    assert_eq!((logits.len(), logits[0].len()), (block, v));
    for t in [0, 5, block / 2, block - 2] {
        let mut changed = window.clone();
        for token in &mut changed[t + 1..] {
            *token = (*token + 1 + t) % v;
        }
        let other = model.logits(&changed).unwrap();
        for (i, (a, b)) in logits.iter().zip(&other).enumerate() {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            if i <= t {
                assert!(
                    diff < 1e-5,
                    "position {i} changed by {diff} when only positions after {t} did"
                );
            } else {
                assert!(
                    diff > 1e-3,
                    "position {i} did not see its changed input ({diff})"
                );
            }
        }
        let prefix = model.logits(&window[..=t]).unwrap();
        for (i, (a, b)) in prefix.iter().zip(&logits).enumerate() {
            let diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-5,
                "a context of {} tokens: position {i} differs by {diff}",
                t + 1
            );
        }
    }

    // The same weights in a GPT written with PyTorch's nn.MultiheadAttention
    // and a causal mask (the example's definition by hand) give the same logits.
    let Some(python) = kiln_testkit::python("the_char_lm_example") else {
        return;
    };
    let weights = dir.join("model.safetensors");
    model
        .model
        .state_dict()
        .unwrap()
        .save_safetensors(&weights, &Default::default())
        .unwrap();
    let windows: Vec<Vec<usize>> = [0, 333, 1234, 2500]
        .iter()
        .map(|&s| model.vocab.encode(&text[s..s + block]).unwrap())
        .collect();
    let ours: Vec<f64> = windows
        .iter()
        .flat_map(|w| model.logits(w).unwrap().concat())
        .map(f64::from)
        .collect();
    let reference = r#"
import json, sys, torch
from safetensors.torch import load_file
w = load_file(sys.argv[1])
v, block, embed, heads, layers = map(int, sys.argv[2:7])
windows = torch.tensor(json.loads(sys.argv[7]))
n, t = windows.shape
x = torch.cat([torch.nn.functional.one_hot(windows, v),
               torch.nn.functional.one_hot(torch.arange(t), block).expand(n, t, block)], -1).float()
def linear(x, p):
    return x @ w[p + ".weight"].T + w[p + ".bias"]
def norm(x, p):
    return torch.nn.functional.layer_norm(x, (embed,), w[p + ".weight"], w[p + ".bias"])
x = linear(x, "0")
mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
for i in range(1, layers + 1):
    attn = torch.nn.MultiheadAttention(embed, heads, batch_first=True)
    attn.load_state_dict({k.removeprefix(f"{i}.0.block.1."): w[k] for k in w if k.startswith(f"{i}.0.block.1.")})
    h = norm(x, f"{i}.0.block.0")
    x = x + attn(h, h, h, attn_mask=mask, need_weights=False)[0]
    h = norm(x, f"{i}.1.block.0")
    x = x + linear(torch.nn.functional.gelu(linear(h, f"{i}.1.block.1")), f"{i}.1.block.3")
logits = linear(norm(x, str(layers + 1)), str(layers + 2))
print(json.dumps(logits.flatten().tolist()))
"#;
    let output = Command::new(&python)
        .args(["-c", reference])
        .arg(&weights)
        .args([v, block, settings.embed, settings.heads, settings.layers].map(|n| n.to_string()))
        .arg(serde_json::to_string(&windows).unwrap())
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the PyTorch GPT: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let expected: Vec<f64> = serde_json::from_slice(&output.stdout).unwrap();
    kiln_testkit::assert_close("logits", &ours, &expected, 1e-4, "PyTorch");
}

#[test]
fn the_example_refuses_a_directory_with_files_and_generates_its_text_from_the_seed() {
    let dir = common::scratch("char-lm-refuses");
    let mine = dir.join("notes.txt");
    std::fs::write(&mine, "mine").unwrap();
    let error = train::<TorchBackend>(&story(0, 500), &dir, &quick())
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("is not empty"), "{error}");
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "mine");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "nothing written"
    );

    let text = story(3, 2000);
    assert_eq!(text, story(3, 2000));
    assert_ne!(text, story(4, 2000));
    assert!(text.len() >= 2000 && text.ends_with(".\n"), "{text}");
    assert!(
        text.lines().all(|l| l.starts_with(char::is_uppercase)),
        "{text}"
    );
}

#[test]
fn the_same_code_learns_the_text_on_tensorflow() {
    let _serial = common::serial();
    let dir = common::scratch("char-lm-tf");
    let model: Trained<TfBackend> = train(&story(7, 6000), &dir.join("run"), &quick()).unwrap();
    let v = model.vocab.len();
    eprintln!(
        "TensorFlow: validation loss {:.4}, unigram entropy {:.4}",
        model.val_loss, model.val_unigram_entropy
    );
    assert!(
        model.val_loss < 0.75 * (v as f64).ln(),
        "{}",
        model.val_loss
    );
    assert!(
        model.val_loss < model.val_unigram_entropy - 0.5,
        "{} vs the context-free bound {}",
        model.val_loss,
        model.val_unigram_entropy
    );
    let sample = model.sample("The ", 40, 0.8, 1).unwrap();
    assert_eq!(sample.chars().count(), 40);
    assert_eq!(model.vocab.encode(&sample).unwrap().len(), 40);
    assert_eq!(model.sample("The ", 40, 0.8, 1).unwrap(), sample);
}
