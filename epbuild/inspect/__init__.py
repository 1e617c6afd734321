"""inspect"""
