"""Settings with which HF's stack (transformers, accelerate, TRL) asks for something the pipeline
does its own way: mapped onto the pipeline's fields, or refused before HF acts on them."""
