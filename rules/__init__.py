"""Op-class rule files (TOML), shipped inside the wheel as ``amp_rewrite.rules``."""
