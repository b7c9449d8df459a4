"""TRL-style supervised fine-tuning on the pipeline."""
