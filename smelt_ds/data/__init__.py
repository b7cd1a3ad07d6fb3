"""Data pipeline: built-in corpus, tokenizer training, preparation into token shards, loader."""
