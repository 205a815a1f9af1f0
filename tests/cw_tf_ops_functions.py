"""The functions of the pipelines in tests/test_data_tf_ops.py, as numpy code (the same
pipelines' TensorFlow versions are in tests/fixtures/tf_ops/make_expected.py).

Each is allowed on workers with ``@data.function``; worker processes import this module.
"""

from __future__ import annotations

import numpy as np

from clusterwire import data, errors

D = data.Dataset


@data.function
def fill(x):
    return np.full([x], x, np.int64)


@data.function
def fill_tuple(x):
    return fill(x), np.full([x, 2], str(int(x)).encode()), x


@data.function
def fill_dict(x):
    return {"v": fill(x), "f": fill(x).astype(np.float32)}


@data.function
def times_two(x):
    return x * 2


@data.function
def times_three(x):
    return x * 3


@data.function
def reciprocal_checked(x):
    if x == 0:
        raise errors.InvalidArgumentError("division by zero")
    return np.float32(1.0) / x


@data.function
def ranges(x):
    return D.range(x)


@data.function
def slices(x):
    return D.from_tensor_slices(x)


@data.function
def repeat_self(x):
    return D.from_tensors(x).repeat(x)


@data.function
def scan_sum(state, x):
    return state + x, state * 2


@data.function
def scan_tuple_state(state, x):
    return (state[0] + x, state[1] * x), state[0] - state[1]


@data.function
def scan_tuple_element(state, element):
    return state + element[0], state * element[1]


@data.function
def below_five(x):
    return x < 5


@data.function
def batch_2(window):
    return window.batch(2)


@data.function
def batch_3(window):
    return window.batch(3)


@data.function
def zip_batch_2(a, b):
    return D.zip((a.batch(2), b.batch(2)))


@data.function
def mod_2(x):
    return x % 2


@data.function
def mod_3(x):
    return x % 3


@data.function
def batch_10(key, window):
    return window.batch(10)


@data.function
def twice_plus_3(key):
    return key * 2 + 3


@data.function
def length(element):
    return np.int64(len(element))


def not_allowed_dataset(x):
    """Returns a Dataset but is not allowed on workers (no @data.function)."""
    return D.range(x)


@data.function
def lines(path):
    return D.from_files(bytes(path).decode())


@data.function
def not_a_dataset(x):
    return 1.0 / x


@data.function
def range_mod_3(x):
    return D.range(x % 3)


@data.function
def range_mod_2(x):
    return D.range(x % 2)


@data.function
def sum_below_16(a, b):
    return a + b < 16


@data.function
def fill_strings_bools(x):
    return np.full([x], b"ab"), np.full([x], True)


@data.function
def identity(x):
    return x


@data.function
def as_string(x):
    return str(int(x)).encode()


@data.function
def scan_pairs(state, x):
    return state - x, (state, x * 2)


@data.function
def mod_4(x):
    return x % 4


@data.function
def inner_reciprocals(x):
    return D.from_tensor_slices(np.array([x + 1.0, 0.0, 2.0], np.float32)).map(
        reciprocal_checked)


@data.function
def reciprocal_of_x_minus_2(x):
    return D.from_tensors(reciprocal_checked(np.float32(x) - np.float32(2.0))).repeat(2)


@data.function
def reciprocal_of_x_mod_3_minus_1(x):
    return D.from_tensors(reciprocal_checked(np.float32(x % 3) - np.float32(1.0))).repeat(2)


@data.function
def range_times_7(x):
    return D.range(x * 7)
