"""Model resolution and download through the Hugging Face Hub cache."""
