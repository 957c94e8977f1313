//! Where `kiln generate` and `[model] pretrained` find a model and how it
//! decodes by default: Hub ids through the local Hugging Face cache, and the
//! sampling settings of `generation_config.json`.

use std::path::Path;

use super::common::{kiln_stdout, scratch};
use super::mock_hub::{MockHub, MockRepo};
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
fn kiln_with_env<V: AsRef<std::ffi::OsStr>>(
    args: &[&str],
    env: &[(&str, V)],
) -> (String, String, bool) {
    let mut command = std::process::Command::new(super::common::KILN);
    command
        .args(args)
        .env("RUST_LOG", "warn")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_HOME")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        // No test asks the real Hub: a closed port unless a test names its own.
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1");
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

    let offline = [
        ("HF_HUB_CACHE", cache.as_path()),
        ("HF_HUB_OFFLINE", Path::new("1")),
    ];
    let (_, stderr, ok) = generate("kiln-test/absent", &[], &offline);
    assert!(!ok);
    assert!(
        stderr.contains("not in the cache")
            && stderr.contains("HF_HUB_OFFLINE is set")
            && stderr.contains("hf download kiln-test/absent"),
        "{stderr}"
    );
    assert!(stderr.contains(cache.to_str().unwrap()), "{stderr}");
    // Online, the cache's answer comes with the download's.
    let (_, stderr, ok) = generate("kiln-test/absent", &[], &by_cache);
    assert!(!ok);
    assert!(
        stderr.contains("is not in the cache")
            && stderr.contains("downloading it from http://127.0.0.1:9 (HF_ENDPOINT) failed")
            && stderr.contains("could not reach the Hub"),
        "{stderr}"
    );
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

/// A model named as on the Hub that the cache lacks is downloaded from
/// `HF_ENDPOINT` (a mock Hub on loopback that answers as huggingface.co does)
/// into the cache, as `huggingface_hub` lays it out: its own
/// `try_to_load_from_cache` finds every file, byte for byte. Only the files
/// Kiln reads are fetched (not `pytorch_model.bin`), sharded weights come
/// with their index, and a second run asks nothing. A gated model wants
/// `HF_TOKEN`; a damaged file, a repository without safetensors, an unknown
/// model, `HF_HUB_OFFLINE` and an unreachable Hub are errors that say so.
#[test]
fn hub_models_the_cache_lacks_are_downloaded_into_it() {
    let test = "hub_models_the_cache_lacks_are_downloaded_into_it";
    let dir = scratch("hub-download");
    let Some(models) = models(test) else {
        return;
    };
    let python = kiln_testkit::python(test).unwrap();
    let llama = models.join("llama");
    let tiny = MockRepo::new("kiln-test/tiny-llama", &llama).with_file("pytorch_model.bin", b"x");
    let commit = tiny.commit().to_owned();
    let pinned = MockRepo::new("kiln-test/pinned", &llama);
    let pinned_commit = pinned.commit().to_owned();
    let hub = MockHub::start(vec![
        tiny,
        pinned,
        MockRepo::new("kiln-test/sharded", &models.join("llama_tied_sharded")),
        MockRepo::new("kiln-test/gated", &llama).gated("hf_secret"),
        MockRepo::new("kiln-test/damaged", &llama).damaged("model.safetensors"),
        MockRepo::new("kiln-test/bin-only", &llama)
            .only(|name| name == "config.json")
            .with_file("pytorch_model.bin", b"x"),
    ]);
    let cache = dir.join("hub");
    let generate = |model: &str, env: &[(&str, &str)]| {
        let mut all = vec![("HF_HUB_CACHE", cache.to_str().unwrap())];
        all.extend_from_slice(env);
        kiln_with_env(
            &[
                "generate",
                "--model",
                model,
                "--prompt-ids",
                "5,9,14,20",
                "--max-new-tokens",
                "4",
                "--stop=-1",
            ],
            &all,
        )
    };
    let online = [("HF_ENDPOINT", hub.url.as_str())];
    let direct = |dir: &Path| generate(dir.to_str().unwrap(), &[]).0;

    let (printed, stderr, ok) = generate("kiln-test/tiny-llama", &online);
    assert!(ok, "{stderr}");
    assert_eq!(printed, direct(&llama), "downloaded against the directory");
    let asked = hub.requests();
    assert!(
        asked.contains(&"GET /api/models/kiln-test/tiny-llama/revision/main".to_owned()),
        "{asked:?}"
    );
    assert!(
        !asked.iter().any(|r| r.contains("pytorch_model.bin")),
        "{asked:?}"
    );
    // huggingface_hub reads what Kiln downloaded, at main and at the commit.
    let files = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    for revision in ["main", commit.as_str()] {
        let mut args = vec![
            "--read".to_owned(),
            cache.to_string_lossy().into_owned(),
            "kiln-test/tiny-llama".into(),
            revision.into(),
        ];
        args.extend(files.iter().map(|f| (*f).to_owned()));
        let script = kiln_testkit::workspace_root().join("tests/reference/hub_cache.py");
        let stdout = kiln_testkit::run_reference(&python, &script, &args);
        let found: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        for file in files {
            let path = found[file].as_str().unwrap();
            assert!(path.contains(&commit), "{file} at {revision}: {path}");
            assert_eq!(
                std::fs::read(path).unwrap(),
                std::fs::read(llama.join(file)).unwrap(),
                "{file} at {revision}"
            );
        }
    }
    let refs = std::fs::read_dir(cache.join("models--kiln-test--tiny-llama/refs")).unwrap();
    let refs: Vec<String> = refs
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        refs,
        ["main"],
        "branches only, as huggingface_hub keeps refs"
    );

    // Cached: nothing is asked, even of a Hub that cannot be reached.
    let before = hub.requests().len();
    let (again, stderr, ok) = generate("kiln-test/tiny-llama", &[]);
    assert!(ok, "{stderr}");
    assert_eq!(again, printed);
    assert_eq!(hub.requests().len(), before, "a cached model asks nothing");

    // A commit downloads as that snapshot, and leaves no ref named by it.
    let (_, stderr, ok) = kiln_with_env(
        &[
            "generate",
            "--model",
            "kiln-test/pinned",
            "--revision",
            &pinned_commit,
            "--prompt-ids",
            "5,9",
            "--max-new-tokens",
            "2",
        ],
        &[
            ("HF_HUB_CACHE", cache.to_str().unwrap()),
            ("HF_ENDPOINT", hub.url.as_str()),
        ],
    );
    assert!(ok, "{stderr}");
    let pinned_dir = cache.join("models--kiln-test--pinned");
    assert!(pinned_dir
        .join("snapshots")
        .join(&pinned_commit)
        .join("config.json")
        .is_file());
    assert!(
        !pinned_dir.join("refs").join(&pinned_commit).exists(),
        "no ref for a commit"
    );

    let (printed, stderr, ok) = generate("kiln-test/sharded", &online);
    assert!(ok, "{stderr}");
    assert_eq!(
        printed,
        direct(&models.join("llama_tied_sharded")),
        "sharded"
    );

    let (_, stderr, ok) = generate("kiln-test/gated", &online);
    assert!(!ok);
    assert!(
        stderr.contains("401") && stderr.contains("set HF_TOKEN"),
        "{stderr}"
    );
    let with_token = [("HF_ENDPOINT", hub.url.as_str()), ("HF_TOKEN", "hf_secret")];
    let (printed, stderr, ok) = generate("kiln-test/gated", &with_token);
    assert!(ok, "{stderr}");
    assert_eq!(printed, again, "gated, with its token");

    let (_, stderr, ok) = generate("kiln-test/damaged", &online);
    assert!(!ok);
    assert!(
        stderr.contains("arrived damaged: its sha256 is"),
        "{stderr}"
    );
    let snapshot = cache.join("models--kiln-test--damaged/snapshots");
    assert!(
        walk(&snapshot)
            .iter()
            .all(|p| !p.ends_with("model.safetensors")),
        "the damaged file is not left in the cache"
    );

    let (_, stderr, ok) = generate("kiln-test/bin-only", &online);
    assert!(!ok);
    assert!(
        stderr.contains("Kiln reads safetensors weights only (it has pytorch_model.bin)"),
        "{stderr}"
    );
    let (_, stderr, ok) = generate("kiln-test/absent", &online);
    assert!(!ok);
    assert!(
        stderr.contains("404") && stderr.contains(&hub.url),
        "{stderr}"
    );

    let before = hub.requests().len();
    let offline = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HUB_OFFLINE", "1")];
    let (_, stderr, ok) = generate("kiln-test/other", &offline);
    assert!(!ok);
    assert!(stderr.contains("HF_HUB_OFFLINE is set"), "{stderr}");
    assert_eq!(hub.requests().len(), before, "HF_HUB_OFFLINE asks nothing");
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
