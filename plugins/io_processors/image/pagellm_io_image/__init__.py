"""pagellm-io-image: images into a vision-language model's prompts, in the front end."""
