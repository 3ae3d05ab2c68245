"""The top floor: the entry points (``train``, ``cli``, ``quickstart``, ``plan_command``) and what a
person sees of a run (start-up lines, interrupts, samples, the summary, the reward plot).
"""
