#!/usr/bin/env python3
"""Trains data/tokenizer.json: a byte-level BPE tokenizer (Hugging Face `tokenizers`, 512
tokens) on data/corpus.txt, for the trainer's tokenizer.json option and its test. Run once
(`pip install tokenizers`); the output is committed."""
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

root = pathlib.Path(__file__).resolve().parent.parent / "data"
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tokenizer.train([str(root / "corpus.txt")], trainer)
tokenizer.save(str(root / "tokenizer.json"))
print(f"tokenizer.json: {tokenizer.get_vocab_size()} tokens")
