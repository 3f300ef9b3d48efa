"""What every family's Hugging Face `transformers` adapter (families/<name>/hf.py, a model/family.py
`HFAdapter`) shares: reading.py reads and checks a transformers directory, conversion.py the name-by-name
moves, tokenizer.py writes the tokenizer files an export carries. No family is named here."""
