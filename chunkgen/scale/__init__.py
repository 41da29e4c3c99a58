"""Splitting one job over several processes or machines without splitting a shared prefix."""
