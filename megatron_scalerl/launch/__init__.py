"""Launching a run: the roles' command lines (`roles`) and the one-machine launcher behind `scalerl train` (`local`)."""
