"""Ways to serve more than one engine behind one endpoint (``ray_serve``: data-parallel replicas on Ray Serve)."""
