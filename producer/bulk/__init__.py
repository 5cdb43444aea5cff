"""Resumable bulk runs: one runner, its line formats, its files beside the output, its registry."""
