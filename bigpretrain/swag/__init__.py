"""SWAG (Singh et al. 2022): the recipe's own library.

vocabulary.py  hashtags canonicalised through WordNet (section 3.1, appendix A)
resampling.py  inverse-square-root head/tail resampling (section 3.1)
zero_shot.py   zero-shot transfer: WordNet hashtag -> class map, Platt scaling (section 4.4)
head_init.py   a fine-tune's classifier head initialised by zero-shot transfer (section 4.2)
The objective is objectives/soft_target.py, the evaluator evaluators/hashtag_zero_shot.py,
the data source input_pipeline/sources/hashtag_source.py.
"""
