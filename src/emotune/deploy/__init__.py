"""Deployment: export (merged model, adapter) and prediction with a trained artifact."""
