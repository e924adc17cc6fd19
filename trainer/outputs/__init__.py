"""What the user sees and keeps: progress on the terminal (progress.py), outputs written
without losing what was there (files.py), and the failures told in one line (failures.py).

The bottom of trainer/: imports recipes/ only, and no jax, so the CLI can use it before
jax starts."""
