"""Shared test fixtures and helpers: real services, real processes, one key prefix per test."""
