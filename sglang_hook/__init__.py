"""sglang_hook"""
