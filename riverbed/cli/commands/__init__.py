"""The commands, one module per subject; importing a module registers its commands."""
