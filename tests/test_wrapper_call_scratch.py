"""A library call's working memory measured in the layouts the generated wrapper hands it
(``remat/wrapper_call_scratch.py``), and Inductor's check counting it at that call.

The real case: a depthwise 3x3 convolution's backward allocates inside itself 3.5 kB when its
gradient and input are channels-last (the layout the joint graph's probe expects) and megabytes when
Inductor hands it a contiguous gradient and an (n, h, c, w)-ordered input, as it did in the backward
of a drawn MobileNet-style corpus CNN (cnn-1294: checked 4.3% under the measured step, now exact).
"""

from __future__ import annotations

import torch

from remat.cost_model.calibrate import TensorLayout
from remat.graph_code import GraphCode
from remat.inductor_check import replay_wrapper
from remat.wrapper_call_scratch import (CallInputs, scratch_at_wrapper_layouts, with_scratch_at_generated_layouts,
                                        wrapper_calls)
from remat.wrapper_text import call_body

DEPTHWISE_BACKWARD = '''
def call(args):
    grad_in, x_saved, weight = args
    args.clear()
    assert_size_stride(grad_in, (2, 48, 48, 48), ({grad_strides}), 'input')
    assert_size_stride(x_saved, (2, 48, 48, 48), ({input_strides}), 'input')
    assert_size_stride(weight, (48, 1, 3, 3), (9, 9, 3, 1), 'input')
    buf0 = empty_strided_cpu((2, 48, 48, 48), ({grad_strides}), torch.float32)
    cpp_fused_0(grad_in, buf0)
    buf1 = torch.ops.aten.convolution_backward.default(buf0, reinterpret_tensor(x_saved, (2, 48, 48, 48), ({input_strides}), 0), weight, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 48, [True, True, False])
    del buf0
    buf2 = buf1[0]
    assert_size_stride(buf2, (2, 48, 48, 48), (110592, 2304, 48, 1), 'torch.ops.aten.convolution_backward.default')
    buf3 = buf1[1]
    assert_size_stride(buf3, (48, 1, 3, 3), (9, 9, 3, 1), 'torch.ops.aten.convolution_backward.default')
    del buf1
    return (buf2, buf3, )
'''
CONTIGUOUS, CHANNELS_LAST, HCW = "110592, 2304, 48, 1", "110592, 1, 2304, 48", "110592, 48, 2304, 1"
FLOAT = {"grad_in": torch.float32, "x_saved": torch.float32, "weight": torch.float32}


def _code(grad: str, saved: str) -> str:
    return DEPTHWISE_BACKWARD.format(grad_strides=grad, input_strides=saved)


def test_the_wrapper_states_each_library_calls_layouts():
    body = call_body(_code(CONTIGUOUS, HCW))
    (call,) = wrapper_calls(body, FLOAT, frozenset({"convolution_backward"}), torch.float32)
    assert (call.result, call.op) == ("buf1", "aten.convolution_backward.default")
    grad, saved, weight = call.args[:3]
    assert grad == TensorLayout((2, 48, 48, 48), (110592, 2304, 48, 1), torch.float32)
    assert saved == TensorLayout((2, 48, 48, 48), (110592, 48, 2304, 1), torch.float32)
    assert weight == TensorLayout((48, 1, 3, 3), (9, 9, 3, 1), torch.float32)
    assert call.args[3:] == ([0], [1, 1], [1, 1], [1, 1], False, [0, 0], 48, [True, True, False])
    assert wrapper_calls(body, FLOAT, frozenset({"convolution"}), torch.float32) == []   # an op not asked for


def test_a_depthwise_backward_is_measured_in_the_layouts_it_is_handed():
    ops = frozenset({"convolution_backward"})
    channels_last = scratch_at_wrapper_layouts(_code(CHANNELS_LAST, CHANNELS_LAST), FLOAT, ops, torch.device("cpu"))
    handed = scratch_at_wrapper_layouts(_code(CONTIGUOUS, HCW), FLOAT, ops, torch.device("cpu"))
    assert set(handed) == set(channels_last) == {"buf1"}
    assert handed["buf1"] > 1_000_000 > 100 * max(channels_last["buf1"], 1)


def test_the_check_adds_a_calls_scratch_by_its_result_through_its_tuple():
    code = _code(CONTIGUOUS, HCW)
    plain = replay_wrapper(code, {}, "cpu")
    scratched = replay_wrapper(code, {}, "cpu", call_scratch={"buf1": 2_000_000})
    other_call = replay_wrapper(code, {}, "cpu", call_scratch={"buf7": 2_000_000})
    assert plain is not None and scratched is not None and other_call is not None
    assert scratched.peak_bytes == plain.peak_bytes + 2_000_000
    assert other_call.peak_bytes == plain.peak_bytes


def test_a_calls_own_measurement_replaces_the_joint_graphs_table_entry():
    # The joint graph's table is keyed by (op, index, output sizes), which another call with the same
    # output can share; a call measured in its own layouts is charged what it measured, less or more.
    code = _code(CONTIGUOUS, HCW)
    table = {("aten.convolution_backward.default", 0, (2, 48, 48, 48)): 3_000_000}
    plain = replay_wrapper(code, {}, "cpu")
    by_table = replay_wrapper(code, {}, "cpu", library_scratch=table)
    own_smaller = replay_wrapper(code, {}, "cpu", library_scratch=table, call_scratch={"buf1": 1_000_000})
    own_none = replay_wrapper(code, {}, "cpu", library_scratch=table, call_scratch={"buf1": 0})
    unmeasured = replay_wrapper(code, {}, "cpu", library_scratch=table, call_scratch={"buf7": 1_000_000})
    assert None not in (plain, by_table, own_smaller, own_none, unmeasured)
    assert by_table.peak_bytes == unmeasured.peak_bytes > plain.peak_bytes + 2_900_000
    assert own_smaller.peak_bytes == plain.peak_bytes + 1_000_000
    assert own_none.peak_bytes == plain.peak_bytes


# Inductor falls back to ``aten.scatter_reduce_`` for a max-pool's backward in code it generates (the joint
# graph has no such node, so the joint graph's probe never measured it): in place, its result unbound.
SCATTER_IN_PLACE = '''
def call(args):
    grad, index = args
    args.clear()
    assert_size_stride(grad, (768, 16), (16, 1), 'input')
    assert_size_stride(index, (768, 16), (1, 768), 'input')
    buf12 = empty_strided_cpu((768, 64), (64, 1), torch.float32)
    cpp_fused_zeros_0(buf12)
    aten.scatter_reduce_.two(buf12,1,index,reinterpret_tensor(grad, (768, 16), (16, 1), 0), reduce='{reduce}', include_self={include_self})
    del grad
    return (buf12, )
'''
SCATTER_DTYPES = {"grad": torch.float32, "index": torch.int64}


def _scatter_code(reduce: str, include_self: bool) -> GraphCode:
    return GraphCode(SCATTER_IN_PLACE.format(reduce=reduce, include_self=include_self), ("grad", "index"), ("buf12",),
                     (768 * 16 * 4, 768 * 16 * 8))


def test_a_call_in_place_that_only_generated_code_makes_is_measured_and_counted_at_its_statement():
    inputs = CallInputs(SCATTER_DTYPES, torch.device("cpu"), torch.float32)
    summed = with_scratch_at_generated_layouts(_scatter_code("sum", True), inputs)
    averaged = with_scratch_at_generated_layouts(_scatter_code("mean", False), inputs)
    assert summed.remeasured_calls == averaged.remeasured_calls == frozenset({"scatter_reduce_"})
    (statement,) = averaged.call_scratch
    assert statement.startswith("aten.scatter_reduce_.two(buf12,1,index,")
    assert summed.call_scratch[next(iter(summed.call_scratch))] == 0      # a sum into the buffer allocates nothing
    assert averaged.call_scratch[statement] > 50_000                        # a mean counts into a buffer of its own
    plain = replay_wrapper(averaged.source_code, {}, "cpu")
    counted = replay_wrapper(averaged.source_code, {}, "cpu", call_scratch=averaged.call_scratch)
    assert plain is not None and counted is not None and "scatter_reduce_" in counted.library_calls
    assert counted.peak_bytes == plain.peak_bytes + averaged.call_scratch[statement]


MATMUL_OUT = '''
def call(args):
    a, b = args
    args.clear()
    assert_size_stride(a, (512, 192), (192, 1), 'input')
    assert_size_stride(b, (576, 192), (192, 1), 'input')
    buf0 = empty_strided_cpu((512, 576), (576, 1), torch.{dtype})
    extern_kernels.mm(a, reinterpret_tensor(b, (192, 576), (1, 192), 0), out=buf0)
    del a
    return (buf0, )
'''


def _matmul_code(dtype: torch.dtype) -> tuple[GraphCode, CallInputs]:
    name = str(dtype).split(".")[1]
    code = GraphCode(MATMUL_OUT.format(dtype=name), ("a", "b"), ("buf0",),
                     (512 * 192 * dtype.itemsize, 576 * 192 * dtype.itemsize))
    return code, CallInputs({"a": dtype, "b": dtype}, torch.device("cpu"), dtype)


def test_a_reduced_precision_matrix_product_is_measured_and_a_float32_one_is_not():
    """``extern_kernels.mm(..., out=buf)`` is the ``aten.mm.out`` overload on the wrapper's layouts: in bfloat16
    (oneDNN packs its operands; 231 kB for these shapes on the 2-core VM) it is measured and the check counts
    it at its statement; in float32 it allocates nothing (``inductor_rules.allocates_nothing``) and is not run."""
    bf16, bf16_inputs = _matmul_code(torch.bfloat16)
    (call,) = wrapper_calls(call_body(bf16.source_code), bf16_inputs.dtypes, frozenset({"mm"}), torch.bfloat16)
    assert call.op == "aten.mm.out" and call.kwargs["out"] == TensorLayout((512, 576), (576, 1), torch.bfloat16)
    assert call.args[1] == TensorLayout((192, 576), (1, 192), torch.bfloat16)
    measured = with_scratch_at_generated_layouts(bf16, bf16_inputs)
    (statement,) = measured.call_scratch
    assert statement.startswith("extern_kernels.mm(a, ") and measured.remeasured_calls == frozenset({"mm"})
    plain = replay_wrapper(measured.source_code, {}, "cpu")
    counted = replay_wrapper(measured.source_code, {}, "cpu", call_scratch=measured.call_scratch)
    assert plain is not None and counted is not None
    assert counted.peak_bytes == plain.peak_bytes + measured.call_scratch[statement]
    fp32, fp32_inputs = _matmul_code(torch.float32)
    assert wrapper_calls(call_body(fp32.source_code), fp32_inputs.dtypes, frozenset({"mm"}), torch.float32) == []
    assert with_scratch_at_generated_layouts(fp32, fp32_inputs).call_scratch == {}


TUPLE_THEN_CALL = '''
def call(args):
    grad, x, w = args
    args.clear()
    assert_size_stride(grad, (2, 8, 6, 6), (288, 36, 6, 1), 'input')
    assert_size_stride(x, (2, 4, 6, 6), (144, 36, 6, 1), 'input')
    assert_size_stride(w, (8, 4, 1, 1), (4, 1, 1, 1), 'input')
    buf0 = torch.ops.aten.convolution_backward.default(grad, x, w, [0], (1, 1), (0, 0), (1, 1), False, (0, 0), 1, [True, True, False])
    buf1 = buf0[0]
    assert_size_stride(buf1, (2, 4, 6, 6), (144, 36, 6, 1), 'torch.ops.aten.convolution_backward.default')
    buf2 = buf0[1]
    assert_size_stride(buf2, (8, 4, 1, 1), (4, 1, 1, 1), 'torch.ops.aten.convolution_backward.default')
    del buf0
    buf3 = torch.ops.aten.convolution.default(buf1, w, None, (1, 1), (0, 0), (1, 1), False, (0, 0), 1)
    assert_size_stride(buf3, (2, 8, 6, 6), (288, 36, 6, 1), 'torch.ops.aten.convolution.default')
    return (buf2, buf3, )
'''


def test_a_library_outputs_dtype_is_the_fx_graphs_where_the_code_does_not_state_it():
    """A library call's output is sized by an ``assert_size_stride`` that states no dtype: re-measuring a call
    that reads it takes the FX graph's dtype of that op's output (its place in the tuple), not the graph's
    most common dtype (under bf16 autocast a float32 guess made a convolution's backward measure 12 kB of
    working memory where it allocates 588 kB, and the check was 13% under the measured step: cnn-1364)."""
    body = call_body(TUPLE_THEN_CALL)
    dtypes = {"grad": torch.bfloat16, "x": torch.bfloat16, "w": torch.bfloat16}
    ops = frozenset({"convolution"})
    (guessed,) = wrapper_calls(body, dtypes, ops, torch.float32)
    assert guessed.args[0].dtype == torch.float32
    (read,) = wrapper_calls(body, dtypes, ops, torch.float32,
                            {("aten.convolution_backward.default", 0): torch.bfloat16,
                             ("aten.convolution_backward.default", 1): torch.float32})
    assert read.args[0] == TensorLayout((2, 4, 6, 6), (144, 36, 6, 1), torch.bfloat16)


def test_a_calls_tuple_places_the_wrapper_never_reads_are_measured_as_working_memory():
    """``buf1 = ...convolution_backward(..., [False, False, True])`` read only at ``buf1[2]``: the call carries
    the places read, so a weight gradient the CPU kernel returns anyway (at place 1, never read) counts in
    the call's measured scratch, not among its outputs (``library_scratch.keeping_places``)."""
    import functools

    from remat.simulator.library_scratch import keeping_places, scratch_of_prepared

    code = '''
def call(args):
    grad, x, w = args
    args.clear()
    assert_size_stride(grad, (4, 16, 4, 4), (256, 16, 4, 1), 'input')
    assert_size_stride(x, (4, 3, 32, 32), (3072, 1024, 32, 1), 'input')
    assert_size_stride(w, (16, 3, 8, 8), (192, 64, 8, 1), 'input')
    buf1 = torch.ops.aten.convolution_backward.default(grad, x, w, [16], (8, 8), (0, 0), (1, 1), False, (0, 0), 1, [False, False, True])
    buf2 = buf1[2]
    assert_size_stride(buf2, (16, ), (1, ), 'torch.ops.aten.convolution_backward.default')
    del buf1
    return (buf2, )
'''
    dtypes = {"grad": torch.float32, "x": torch.float32, "w": torch.float32}
    ops = frozenset({"convolution_backward"})
    (call,) = wrapper_calls(call_body(code), dtypes, ops, torch.float32)
    assert call.read_places == frozenset({2})
    op, args = torch.ops.aten.convolution_backward.default, (torch.randn(4, 16, 4, 4), torch.randn(4, 3, 32, 32),
                                                              torch.randn(16, 3, 8, 8), [16], [8, 8], [0, 0], [1, 1],
                                                              False, [0, 0], 1, [False, False, True])
    weight_grad = op(*args)[1]
    if weight_grad is None:
        return    # this CPU's kernel returns no weight gradient: nothing more to count (read_places is checked)
    (every_place_an_output,) = scratch_of_prepared([lambda: functools.partial(keeping_places, None, op, *args)],
                                                   torch.device("cpu"))
    assert (scratch_at_wrapper_layouts(code, dtypes, ops, torch.device("cpu"))["buf1"]
            == every_place_an_output + weight_grad.untyped_storage().nbytes())
