#!/usr/bin/env python3
"""Convert the NLTK Brown corpus (tagged, Form C) to plain text and split it.

Input : brown.zip from nltk_data (packages/corpora/brown.zip) or its extracted
        'brown/' directory (500 files ca01..cr09, one sentence per non-blank
        line, tokens written as word/TAG).
Output: <out>/brown.txt         all 57,340 sentences, one per line, tags stripped
        <out>/train.txt         first --train sentences (default 40,000)
        <out>/valid.txt         next half of the remainder
        <out>/test.txt          the rest
Sentences are taken in file-id order (ca01, ca02, ..., cr09), the same order as
nltk.corpus.brown.sents(). The split is sequential by default; with --seed N the
sentence list is shuffled with random.Random(N) before splitting. Both are
deterministic. Words keep their original case unless --lower is given.
Tag stripping follows nltk.tag.str2tuple: the tag is everything after the LAST
'/', so words such as '1/2' survive intact.

Usage: python3 prepare_brown.py [--src brown.zip|brown/] [--out DIR]
                                [--train 40000] [--seed N] [--lower]
"""

import argparse
import os
import random
import re
import zipfile

FILEID = re.compile(r"c[a-r]\d\d")


def read_files(src):
    """Yield (fileid, text) for the 500 corpus files in sorted order."""
    if os.path.isdir(src):
        names = sorted(n for n in os.listdir(src) if FILEID.fullmatch(n))
        for n in names:
            with open(os.path.join(src, n), encoding="ascii") as fh:
                yield n, fh.read()
    else:
        with zipfile.ZipFile(src) as z:
            names = sorted(n for n in z.namelist() if FILEID.fullmatch(n.rsplit("/", 1)[-1]))
            for n in names:
                yield n.rsplit("/", 1)[-1], z.read(n).decode("ascii")


def sentences(src, lower=False):
    for _, text in read_files(src):
        for line in text.splitlines():
            toks = line.split()
            if not toks:
                continue
            words = [t[: t.rfind("/")] if "/" in t else t for t in toks]
            if lower:
                words = [w.lower() for w in words]
            yield " ".join(words)


def write(path, lines):
    with open(path, "w", encoding="ascii", newline="\n") as fh:
        for s in lines:
            fh.write(s + "\n")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(here, "brown", "brown.zip"))
    ap.add_argument("--out", default=os.path.join(here, "brown", "text"))
    ap.add_argument("--train", type=int, default=40000)
    ap.add_argument("--seed", type=int, default=None, help="shuffle sentences with random.Random(seed) first")
    ap.add_argument("--lower", action="store_true")
    a = ap.parse_args()

    sents = list(sentences(a.src, a.lower))
    os.makedirs(a.out, exist_ok=True)
    write(os.path.join(a.out, "brown.txt"), sents)
    order = list(sents)
    if a.seed is not None:
        random.Random(a.seed).shuffle(order)
    n_train = a.train
    n_valid = (len(order) - n_train) // 2
    parts = {"train": order[:n_train], "valid": order[n_train : n_train + n_valid], "test": order[n_train + n_valid :]}
    for name, lines in parts.items():
        write(os.path.join(a.out, name + ".txt"), lines)
    n_words = sum(len(s.split()) for s in sents)
    print(f"{len(sents)} sentences, {n_words} words -> {a.out}")
    for name, lines in parts.items():
        print(f"  {name}: {len(lines)} sentences, {sum(len(s.split()) for s in lines)} words")


if __name__ == "__main__":
    main()
