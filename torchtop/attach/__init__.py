"""``torchtop attach`` to a job started without torchtop: start an agent inside it from outside
(:mod:`torchtop.attach.inject`), or, where that is refused, watch it from outside
(:mod:`torchtop.streams.outside`). Never imports torch."""
