"""A Hugging Face cache laid out as huggingface_hub lays it out (tests/cli_pretrained.rs).

Usage: python hub_cache.py CACHE REPO_ID MAIN_DIR TAG_DIR
       python hub_cache.py --read CACHE REPO_ID REVISION FILE...

Writes CACHE/models--<org>--<name>/ with the files of MAIN_DIR as the commit that
refs/main names and those of TAG_DIR as the commit that refs/v1 names: each file a blob
named by its sha256 under blobs/, linked from snapshots/<commit>/ (as `hf download`
leaves them). Then reads config.json back through huggingface_hub's own
try_to_load_from_cache for "main", "v1" and the second commit, and prints
{"main": path, "v1": path, "commit": hash, "by_commit": path} as JSON.

With --read, finds each FILE of REPO_ID at REVISION in CACHE (a cache Kiln
downloaded into) through try_to_load_from_cache, and prints {FILE: path} as JSON;
a file it does not find is an error.
"""

import hashlib
import json
import os
import sys

from huggingface_hub import try_to_load_from_cache


def add_commit(repo, commit, source):
    blobs = os.path.join(repo, "blobs")
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        blob = os.path.join(blobs, hashlib.sha256(data).hexdigest())
        if not os.path.exists(blob):
            with open(blob, "wb") as f:
                f.write(data)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))


def main(cache, repo_id, main_dir, tag_dir):
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    commits = {"main": hashlib.sha1(b"main").hexdigest(), "v1": hashlib.sha1(b"v1").hexdigest()}
    for ref, source in (("main", main_dir), ("v1", tag_dir)):
        add_commit(repo, commits[ref], source)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commits[ref])
    found = {rev: try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=rev)
             for rev in ("main", "v1", commits["v1"])}
    for rev, path in found.items():
        if not isinstance(path, str):
            raise AssertionError(f"huggingface_hub does not find config.json at {rev}: {path}")
    print(json.dumps({"main": found["main"], "v1": found["v1"], "commit": commits["v1"],
                      "by_commit": found[commits["v1"]]}))


def read(cache, repo_id, revision, *files):
    found = {}
    for name in files:
        path = try_to_load_from_cache(repo_id, name, cache_dir=cache, revision=revision)
        if not isinstance(path, str):
            raise AssertionError(f"huggingface_hub does not find {name} at {revision}: {path}")
        found[name] = path
    print(json.dumps(found))


if __name__ == "__main__":
    if sys.argv[1] == "--read":
        read(*sys.argv[2:])
    else:
        main(*sys.argv[1:5])
