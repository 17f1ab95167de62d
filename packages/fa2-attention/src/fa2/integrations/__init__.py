"""fa2 inside other libraries; each integration is imported on its own and needs that library installed."""
