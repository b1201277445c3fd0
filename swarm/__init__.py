"""Shared core of SWARM: model stages, codecs, wire format, config. Importing it starts nothing."""
