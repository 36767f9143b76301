"""The cells' isolated uv environments (envs/NAME.toml, constraints/NAME.txt) and the torch
build each one takes."""
