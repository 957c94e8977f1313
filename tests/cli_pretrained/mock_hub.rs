//! A Hub on loopback for the download tests: the endpoints the `hf-hub`
//! client asks (`/api/models/<id>/revision/<rev>` for the file list, and
//! `/<id>/resolve/<rev>/<file>` with a `Range` for each file's metadata and
//! bytes), answered as huggingface.co answers them (`ETag` the sha256 of the
//! file, `X-Repo-Commit`, `Content-Range`), and every request recorded.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// One repository the mock Hub serves at `main` and at its commit.
pub struct MockRepo {
    id: String,
    commit: String,
    files: Vec<(String, Vec<u8>)>,
    /// The token a gated repository wants.
    token: Option<String>,
    /// A file whose bytes differ from its `ETag`'s sha256.
    damaged: Option<String>,
}

impl MockRepo {
    /// The files of directory `dir`, as repository `id`.
    pub fn new(id: &str, dir: &Path) -> Self {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&p).unwrap())
            })
            .collect();
        files.sort();
        MockRepo {
            id: id.to_owned(),
            commit: hex(&Sha256::digest(id.as_bytes()))[..40].to_owned(),
            files,
            token: None,
            damaged: None,
        }
    }

    /// With file `name` holding `bytes` as well.
    pub fn with_file(mut self, name: &str, bytes: &[u8]) -> Self {
        self.files.push((name.to_owned(), bytes.to_vec()));
        self
    }

    /// Without the files `keep` rejects.
    pub fn only(mut self, keep: impl Fn(&str) -> bool) -> Self {
        self.files.retain(|(name, _)| keep(name));
        self
    }

    /// Answering 401 unless `Authorization: Bearer <token>` comes.
    pub fn gated(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    /// Serving `name` with one byte changed.
    pub fn damaged(mut self, name: &str) -> Self {
        self.damaged = Some(name.to_owned());
        self
    }

    /// The repository's commit.
    pub fn commit(&self) -> &str {
        &self.commit
    }
}

/// The mock Hub: its address and the requests it received.
pub struct MockHub {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    requests: Arc<Mutex<Vec<String>>>,
}

impl MockHub {
    /// Serves `repos` on a free loopback port until the test process ends.
    pub fn start(repos: Vec<MockRepo>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                answer(stream, &repos, &log);
            }
        });
        MockHub { url, requests }
    }

    /// The request lines received so far (`GET /api/models/...`).
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

fn answer(stream: TcpStream, repos: &[MockRepo], log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let (mut range, mut authorization) = (None, None);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').unwrap_or((&header, ""));
        match name.trim().to_ascii_lowercase().as_str() {
            "range" => range = Some(value.trim().to_owned()),
            "authorization" => authorization = Some(value.trim().to_owned()),
            _ => {}
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    log.lock().unwrap().push(
        line.split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" "),
    );
    let (status, headers, body) = route(&path, range.as_deref(), authorization.as_deref(), repos);
    let mut out = stream;
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let _ = out.write_all(head.as_bytes());
    let _ = out.write_all(&body);
}

type Answer = (&'static str, Vec<(&'static str, String)>, Vec<u8>);

fn route(path: &str, range: Option<&str>, auth: Option<&str>, repos: &[MockRepo]) -> Answer {
    let json = |status, text: String| {
        (
            status,
            vec![("Content-Type", "application/json".into())],
            text.into_bytes(),
        )
    };
    let not_found = || {
        json(
            "404 Not Found",
            r#"{"error":"Repository not found"}"#.into(),
        )
    };
    let (api, rest) = match path.strip_prefix("/api/models/") {
        Some(rest) => (true, rest),
        None => (false, path.trim_start_matches('/')),
    };
    let separator = if api { "/revision/" } else { "/resolve/" };
    let Some((id, rest)) = rest.split_once(separator) else {
        return not_found();
    };
    let Some(repo) = repos.iter().find(|r| r.id == id) else {
        return not_found();
    };
    if let Some(token) = &repo.token {
        if auth != Some(format!("Bearer {token}").as_str()) {
            return json(
                "401 Unauthorized",
                r#"{"error":"Access to this model is restricted"}"#.into(),
            );
        }
    }
    let (revision, file) = match api {
        true => (rest, None),
        false => match rest.split_once('/') {
            Some((revision, file)) => (revision, Some(file)),
            None => return not_found(),
        },
    };
    if revision != "main" && revision != repo.commit {
        return json("404 Not Found", r#"{"error":"Revision not found"}"#.into());
    }
    let Some(file) = file else {
        let siblings: Vec<serde_json::Value> = repo
            .files
            .iter()
            .map(|(name, _)| serde_json::json!({ "rfilename": name }))
            .collect();
        let info = serde_json::json!({ "id": repo.id, "sha": repo.commit, "siblings": siblings });
        return json("200 OK", info.to_string());
    };
    let Some((name, bytes)) = repo.files.iter().find(|(name, _)| name == file) else {
        return json("404 Not Found", r#"{"error":"Entry not found"}"#.into());
    };
    let etag = hex(&Sha256::digest(bytes));
    let mut bytes = bytes.clone();
    if repo.damaged.as_deref() == Some(name.as_str()) {
        bytes[0] ^= 1;
    }
    let size = bytes.len();
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = if b.is_empty() {
                size - 1
            } else {
                b.parse().unwrap()
            };
            (a, b.min(size - 1))
        }
        None => (0, size - 1),
    };
    (
        "206 Partial Content",
        vec![
            ("ETag", format!("\"{etag}\"")),
            ("X-Repo-Commit", repo.commit.clone()),
            ("Content-Range", format!("bytes {start}-{end}/{size}")),
        ],
        bytes[start..=end].to_vec(),
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
