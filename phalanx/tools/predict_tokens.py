"""`phalanx predict` for a token_classify run: tag each word of each sentence, keeping the input's words.

CoNLL out when --output ends in .conll (word TAB predicted tag, a blank line after each sentence); JSON Lines
otherwise: per sentence its tokens, tags, each tag's probability, and the entities (seqeval's spans) with their
words and mean probability. With --nproc-per-node N each worker tags a contiguous share; rank 0 writes all.
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np

from phalanx.core import dist
from phalanx.core.config import Config
from phalanx.core.runfolder import EXIT_OK
from phalanx.data.tokcls import inputs
from phalanx.data.tokcls import labels as tag_names
from phalanx.model.build import load_token_classifier
from phalanx.tasks.token_classify import tag_sentences
from phalanx.tools.predict import emit, launch, open_share


def run(args, cfg: Config) -> int:
    sentences, carried = inputs.read_sentences(args.input, cfg)  # checked here, before any worker starts
    if args.nproc_per_node > 1 and not dist.under_torchrun():
        return launch(args)
    share = open_share(cfg, args.run, len(sentences), load_token_classifier)
    t = cfg.token_classify
    tagged = tag_sentences(share.model, share.tokenizer, sentences[share.shard.start:share.shard.stop], t.max_length,
                           t.stride, args.batch_size, share.device)
    parts = share.gather(tagged)
    if parts is not None:
        config = share.model.config
        names = [config.id2label[i] for i in range(config.num_labels)]
        write(sentences, [x for part in parts for x in part], names, args.output)
        unknown = Counter(t for t in carried if t not in set(names))
        if unknown:  # the input's own tags (a labelled file): those the model cannot predict, counted
            print(f"phalanx: predict: {sum(unknown.values())} words of '{args.input}' carry tags the model has no "
                  f"label for: {', '.join(f'{k} ({v})' for k, v in unknown.most_common(10))}", file=sys.stderr)
    share.close()
    return EXIT_OK


def entities(tags: list[str], scores: np.ndarray, words: list[str]) -> list[dict]:
    """seqeval's entity spans of one sentence (its default mode; plain tags: each run of one tag), with their
    words and their words' mean probability; `end` is exclusive."""
    from seqeval.metrics.sequence_labeling import get_entities

    plain = all(tag_names.split_tag(t)[0] in ("", "O") for t in tags)
    spans = get_entities(tag_names.for_seqeval(tags, plain) if plain else tags)
    return [{"type": kind, "start": lo, "end": hi + 1, "words": words[lo:hi + 1],
             "score": round(float(np.mean(scores[lo:hi + 1])), 6)} for kind, lo, hi in spans]


def write(sentences: list[list[str]], tagged: list, names: list[str], output: str) -> None:
    if output.endswith(".conll"):
        text = "".join("".join(f"{w}\t{names[int(i)]}\n" for w, i in zip(words, ids)) + "\n"
                       for words, (ids, _) in zip(sentences, tagged))
    else:
        lines = []
        for words, (ids, scores) in zip(sentences, tagged):
            tags = [names[int(i)] for i in ids]
            lines.append(json.dumps({"tokens": words, "tags": tags, "scores": [round(float(p), 6) for p in scores],
                                     "entities": entities(tags, scores, words)}, ensure_ascii=False))
        text = "".join(line + "\n" for line in lines)
    emit(text, output)
