"""The orchestration above io and engine: settings resolution, the batch job, side-by-side benches."""
