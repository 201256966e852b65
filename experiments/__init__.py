"""Research experiments: each module holds one config (`get_config`) and its Trainer subclass."""
