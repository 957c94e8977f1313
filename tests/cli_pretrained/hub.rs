//! Where `kiln generate` and `[model] pretrained` find a model and how it
//! decodes by default: Hub ids through the local Hugging Face cache, and the
//! sampling settings of `generation_config.json`.

use std::path::Path;

use super::common::{kiln_stdout, scratch};
use super::{config, models, token_csv};

/// A model whose `generation_config.json` samples (`do_sample`, its
/// temperature and top-k) samples with them in `kiln generate`, as
/// `transformers`' `generate()` does; flags override them; `--greedy` decodes
/// greedily anyway.
#[test]
fn kiln_generate_honours_generation_config_sampling() {
    let test = "kiln_generate_honours_generation_config_sampling";
    let dir = scratch("generation-config");
    let Some(models) = models(test) else {
        return;
    };
    let original = models.join("llama");
    let sampling = dir.join("llama-sampling");
    std::fs::create_dir_all(&sampling).unwrap();
    for entry in std::fs::read_dir(&original).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, sampling.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::write(
        sampling.join("generation_config.json"),
        r#"{"do_sample": true, "temperature": 0.7, "top_k": 5, "top_p": 1.0, "eos_token_id": [2]}"#,
    )
    .unwrap();
    let run = |model: &Path, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt-ids",
            "5,9,14",
            "--max-new-tokens",
            "8",
            "--stop=-1",
            "--seed",
            "3",
        ];
        args.extend_from_slice(extra);
        kiln_stdout(&args)
    };
    let sampled = run(&sampling, &[]);
    assert_eq!(
        sampled,
        run(&original, &["--temperature", "0.7", "--top-k", "5"]),
        "the file's settings"
    );
    let greedy = run(&original, &[]);
    assert_ne!(sampled, greedy, "do_sample samples");
    assert_eq!(run(&sampling, &["--greedy"]), greedy, "--greedy");
    assert_eq!(
        run(&sampling, &["--temperature", "1.3"]),
        run(&original, &["--temperature", "1.3", "--top-k", "5"]),
        "a flag overrides its own setting only"
    );
}

/// `kiln` with `env` set, and what it printed (stdout, stderr, success).
fn kiln_with_env(args: &[&str], env: &[(&str, &Path)]) -> (String, String, bool) {
    let mut command = std::process::Command::new(super::common::KILN);
    command
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_HOME");
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command.output().unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

/// `[model] pretrained = "org/name"` and `kiln generate --model org/name`
/// find the model in a Hugging Face cache that `huggingface_hub`'s own
/// `try_to_load_from_cache` reads (`HF_HUB_CACHE`, or `HF_HOME/hub`), at
/// `main`, at a tag and at a commit, exactly as the directory itself; a model
/// the cache lacks is an error naming the cache and how to fetch it.
#[test]
fn models_named_as_on_the_hub_resolve_through_the_hugging_face_cache() {
    let test = "models_named_as_on_the_hub_resolve_through_the_hugging_face_cache";
    let dir = scratch("hub-cache");
    let Some(models) = models(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let home = dir.join("home");
    let cache = home.join("hub");
    let repo = "kiln-test/tiny-llama";
    let out = std::process::Command::new(&python)
        .arg(kiln_testkit::workspace_root().join("tests/reference/hub_cache.py"))
        .arg(&cache)
        .arg(repo)
        .arg(models.join("llama"))
        .arg(models.join("qwen3"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let found: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let commit = found["commit"].as_str().unwrap().to_owned();

    let generate = |model: &str, extra: &[&str], env: &[(&str, &Path)]| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt-ids",
            "5,9,14,20",
            "--max-new-tokens",
            "4",
            "--stop=-1",
        ];
        args.extend_from_slice(extra);
        kiln_with_env(&args, env)
    };
    let direct = |family: &str| generate(models.join(family).to_str().unwrap(), &[], &[]).0;
    let (llama, qwen3) = (direct("llama"), direct("qwen3"));
    assert_ne!(llama, qwen3, "the two commits must generate differently");
    let by_cache = [("HF_HUB_CACHE", cache.as_path())];
    let by_home = [("HF_HOME", home.as_path())];
    for (extra, env, expected, what) in [
        (&[][..], &by_cache[..], &llama, "main through HF_HUB_CACHE"),
        (&[][..], &by_home[..], &llama, "main through HF_HOME"),
        (&["--revision", "v1"][..], &by_cache[..], &qwen3, "tag v1"),
        (
            &["--revision", commit.as_str()][..],
            &by_cache[..],
            &qwen3,
            "the commit",
        ),
    ] {
        let (printed, stderr, ok) = generate(repo, extra, env);
        assert!(ok, "{what}: {stderr}");
        assert_eq!(&printed, expected, "{what}: against the directory itself");
    }

    let (_, stderr, ok) = generate("kiln-test/absent", &[], &by_cache);
    assert!(!ok);
    assert!(
        stderr.contains("not in the cache") && stderr.contains("hf download kiln-test/absent"),
        "{stderr}"
    );
    assert!(stderr.contains(cache.to_str().unwrap()), "{stderr}");
    let (_, stderr, ok) = generate(repo, &["--revision", "v9"], &by_cache);
    assert!(!ok);
    assert!(stderr.contains("refs: main, v1"), "{stderr}");

    // The config key, with its revision: the same definition as the directory's.
    let csv = token_csv(&dir);
    let inspect = |model: &str, extra: &str| {
        let config = config(&dir, Path::new(model), &csv, "hub", "");
        let text = std::fs::read_to_string(&config)
            .unwrap()
            .replace("num_labels = 2", &format!("num_labels = 2\n{extra}"));
        std::fs::write(&config, text).unwrap();
        kiln_with_env(&["inspect", config.to_str().unwrap()], &by_cache)
    };
    let (named, stderr, ok) = inspect(repo, "revision = \"v1\"");
    assert!(ok, "{stderr}");
    let (local, _, _) = inspect(models.join("qwen3").to_str().unwrap(), "");
    assert_eq!(named, local, "[model] pretrained = {repo:?} at v1");
    let (main, _, _) = inspect(repo, "");
    assert_ne!(main, named, "main is the LLaMA, v1 the Qwen3");
    assert!(
        main.contains("q_proj")
            || main.contains("SelfAttention")
            || main.contains("self_attention"),
        "{main}"
    );
}
