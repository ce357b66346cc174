"""The quality pipeline's corpus: the Python sources and documentation installed on the machine.

Files are read in the order of a hash of their path (below their root, so that the order does not depend on where
Python is installed) and split by a second, independent hash into train and held-out, one JSON line a file:
{"text", "kind"}, the kind "code" (.py, .pyi) or "prose" (.rst, .md, .txt), so that held-out figures can be
told apart by domain. A conversion of several passes (--convert-epochs) reads a head of the train split
(`make_subset`): its first documents up to a number of tokens, the last cut, beside the same held-out file.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sysconfig
from pathlib import Path

KINDS = {".py": "code", ".pyi": "code", ".rst": "prose", ".md": "prose", ".txt": "prose"}
KIND_NAMES = ("code", "prose")
MIN_BYTES, MAX_BYTES = 500, 200_000
PACKAGE_FOLDERS = ("site-packages", "dist-packages")


def source_files(packages: bool = True) -> list[tuple[str, Path]]:
    """(key, path) of every candidate file of the standard library (and with `packages`, site-packages);
    the key (the path below its folder) orders and splits the corpus, so that it does not depend on where
    Python is installed."""
    roots = {Path(sysconfig.get_paths()[k]) for k in (("stdlib", "purelib", "platlib") if packages else ("stdlib",))}
    found = {}
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in PACKAGE_FOLDERS]  # walked as roots of their own, or not at all
            for name in names:
                path = Path(folder, name)
                if path.suffix in KINDS:
                    found[f"{root.name}/{path.relative_to(root)}"] = path
    return sorted(found.items(), key=lambda item: hashlib.sha1(item[0].encode()).digest())


def held_out(key: str, share: float) -> bool:
    """Whether a file goes to the held-out split: a second hash, independent of the reading order's."""
    return hashlib.sha1(f"held-out:{key}".encode()).digest()[0] < 256 * share


def make_corpus(out: Path, megabytes: float, valid_share: float, packages: bool = True) -> dict:
    """train.jsonl and valid.jsonl (one {"text", "kind"} a file) of up to `megabytes` of distinct texts."""
    seen, sizes, counts = set(), {"train": 0, "valid": 0}, {"train": 0, "valid": 0}
    kinds = {split: dict.fromkeys(KIND_NAMES, 0) for split in sizes}
    out.mkdir(parents=True, exist_ok=True)
    files = {split: open(out / f"{split}.jsonl.tmp", "w") for split in sizes}
    for key, path in source_files(packages):
        if sum(sizes.values()) >= megabytes * 1e6:
            break
        try:
            if not MIN_BYTES <= path.stat().st_size <= MAX_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if digest in seen:
            continue
        seen.add(digest)
        split, kind = "valid" if held_out(key, valid_share) else "train", KINDS[path.suffix]
        files[split].write(json.dumps({"text": text, "kind": kind}) + "\n")
        sizes[split] += len(text.encode())
        counts[split] += 1
        kinds[split][kind] += 1
    for split, f in files.items():
        f.close()
        (out / f"{split}.jsonl.tmp").rename(out / f"{split}.jsonl")
    return {"source": f"Python {platform.python_version()} standard library{' and site-packages' * packages}: "
                      f"{', '.join(KINDS)} files of {MIN_BYTES}-{MAX_BYTES} bytes, distinct texts, in the order "
                      f"of a hash of their path", "files": counts, "bytes": sizes, "kinds": kinds}


def make_subset(corpus: Path, out: Path, tokenizer, seq_len: int, tokens: int) -> dict:
    """OUT: the head of CORPUS's train split that sparsify's reader (EOS after each document, blocks of seq_len,
    the tail short of a block dropped) packs into the blocks of the split's first `tokens` tokens (rounded up to a
    block), and a copy of the held-out split; written to a temporary folder renamed into place. Its documents are
    the split's first ones, the last cut after the tokens it adds to the head and half a block more (the margin keeps
    the retokenized end of its text out of the head's blocks; kept whole where the cut would change its tokens
    before that). Returns its documents and bytes and, counted by that reader, its blocks and their tokens
    (`distinct_tokens`: what each pass over it trains on)."""
    from sparsify.data import Documents, Packer, blocks
    from sparsify.locations import resolve_data

    wanted = -(-tokens // seq_len) * seq_len
    eos = len(Packer(tokenizer, seq_len).sep)

    def encoded(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return ids["input_ids"], ids["offset_mapping"]

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    read, documents, size = 0, 0, 0
    with open(corpus / "train.jsonl") as source, open(tmp / "train.jsonl", "w") as head:
        for line in source:
            row = json.loads(line)
            ids, offsets = encoded(row["text"])
            needed, kept = wanted - read, wanted - read + seq_len // 2
            if kept < len(ids):  # the document that completes the head, and more: cut
                cut = row["text"][:offsets[kept - 1][1]]
                cut_ids = encoded(cut)[0]
                if cut_ids[:needed] == ids[:needed]:
                    row["text"], ids = cut, cut_ids
            head.write(json.dumps(row) + "\n")
            read, documents, size = read + len(ids) + eos, documents + 1, size + len(row["text"].encode())
            if read >= wanted:
                break
    if read < wanted:
        shutil.rmtree(tmp)
        raise SystemExit(f"{corpus / 'train.jsonl'} holds {read:,} tokens, fewer than the {tokens:,} a pass over a "
                         f"head of it should hold: lower --convert-share or raise --corpus-mb")
    shutil.copyfile(corpus / "valid.jsonl", tmp / "valid.jsonl")
    packed = sum(1 for _ in blocks(iter(Documents(resolve_data(tmp).train)), tokenizer, seq_len))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"tokens_asked": tokens, "documents": documents, "bytes": size, "blocks": packed,
            "distinct_tokens": packed * seq_len}


def read_texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in open(path)]


def read_documents(path: Path) -> dict[str, list[str]]:
    """The texts of a split by kind ({"code": [...], "prose": [...]}); a clear error for a split made without kinds."""
    documents = {kind: [] for kind in KIND_NAMES}
    for number, line in enumerate(open(path), 1):
        row = json.loads(line)
        if "kind" not in row:
            raise SystemExit(f"{path}: line {number} records no document kind (code or prose), which the held-out "
                             f"metrics need: the corpus was made without them. Remove {path.parent} and "
                             f"{path.parent.with_suffix('.json')} to make it again (the same files from the same "
                             f"Python installation), or pass --no-metrics")
        documents[row["kind"]].append(row["text"])
    return documents
