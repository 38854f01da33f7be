"""Speculative decoding (NEXTN chain with the MTP layer, then DSpark block drafting).

Empty until the speculation issue lands; the model already exposes `LingModel.mtp_forward`.
"""
