"""tracking package."""
