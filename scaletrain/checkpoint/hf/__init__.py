"""Hugging Face `transformers` conversion: one module per family (gpt, bert, llama, t5), each with an `ADAPTER`
(model/family.py `HFAdapter`) that its `ModelFamily.hf` names; conversion.py holds what they share and
tokenizer.py writes the tokenizer files an export carries."""
