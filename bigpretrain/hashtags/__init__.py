"""SWAG hashtags: the WordNet vocabulary (canonical hashtags) and head/tail resampling."""
