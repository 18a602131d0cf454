"""Building the model and tokenizer from a local directory; export to Hugging Face format."""
