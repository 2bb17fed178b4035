"""The analytic cost model of `scaletrain plan`: memory, step time and communication of any layout on any cluster,
from formulas, without torch. Split by term (see `scaletrain.plan`);
the entry is `estimate.estimate`."""
