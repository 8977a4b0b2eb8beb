"""Pictures of what the model computes: attention maps for TensorBoard, a PNG grid and the
self-contained HTML inspector (attention_maps.py, inspector.html).

Usage:
    from viz.attention_maps import attention_maps, write_html
"""
