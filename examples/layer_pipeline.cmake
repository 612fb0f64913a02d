# The synthetic layer pipeline (examples/layer_pipeline.h), a static library shared by the example
# program and the pipeline benchmark. Included from examples/ and benchmarks/; defined once.
include_guard(GLOBAL)

add_library(reviva_layer_pipeline STATIC ${PROJECT_SOURCE_DIR}/examples/layer_pipeline.cpp)
target_include_directories(reviva_layer_pipeline PUBLIC ${PROJECT_SOURCE_DIR}/examples)
target_link_libraries(reviva_layer_pipeline PUBLIC reviva)
target_compile_options(reviva_layer_pipeline PRIVATE -Wall -Wextra -Wpedantic)
if(REVIVA_WITH_CUDA)
  # The GEMMs of the CUDA backend; the host backend's simulation needs nothing.
  target_compile_definitions(reviva_layer_pipeline PRIVATE REVIVA_EXAMPLES_WITH_CUDA=1)
  target_link_libraries(reviva_layer_pipeline PRIVATE CUDA::cublas CUDA::cudart)
endif()
