"""The inspector: what graphxform shows people about a graph and what a transformation did.

- scopes: the collapsed picture every view draws (replicas folded, scopes collapsed, edges
  bundled);
- viz: DOT/SVG/PNG/PDF pictures, and TensorBoard event files (tensorboard);
- html: one self-contained page to explore a graph (its JavaScript ships in ``static/``);
- diff: what changed between two graphs, by scope and by the pass that made it;
- check: static checks of a transformed graph before anyone runs it;
- explain: why each variable was placed as it was (`apply --explain`);
- cost: bytes each task sends and receives per step (`graphxform cost`);
- report: what a training graph holds (`graphxform inspect`).

Nothing here changes a graph; the compiler never imports the inspector (the pipeline is handed
a dump function instead)."""
