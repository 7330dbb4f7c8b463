# install.find_package_consumer: install the built library into a fresh prefix, then configure, build
# and run tests/install/consumer (find_package(capsnet) + capsnet::capsnet) against it. Stops at the
# first failing step and names it.
#   cmake -DBUILD_DIR=<capsnet build> -DSOURCE_DIR=<capsnet source> -DWORK_DIR=<scratch>
#         [-DTorch_DIR=...] [-DGENERATOR=...] [-DCXX_COMPILER=...] [-DBUILD_TYPE=...]
#         [-DLIBDIR=lib] [-DINCLUDEDIR=include] [-DBINDIR=bin] -P check_install.cmake
# LIBDIR etc. are the project's CMAKE_INSTALL_<dir> (GNUInstallDirs gives other values in script mode).
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT ${var})
    message(FATAL_ERROR "check_install.cmake: -D${var}=... is required")
  endif()
endforeach()
foreach(pair BUILD_TYPE=Release LIBDIR=lib INCLUDEDIR=include BINDIR=bin)
  string(REPLACE "=" ";" pair "${pair}")
  list(GET pair 0 var)
  list(GET pair 1 default)
  if(NOT ${var})
    set(${var} ${default})
  endif()
endforeach()

set(prefix ${WORK_DIR}/prefix)
set(consumer_build ${WORK_DIR}/consumer-build)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

# Runs one step; on failure stops the test with the step's name, command and exit status.
function(step name)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "[${name}] ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install.find_package_consumer: step '${name}' failed (exit status ${rc}):\n  ${shown}")
  endif()
endfunction()

# 1. Install into an empty prefix.
step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --config ${BUILD_TYPE})

# 2. What must be there, and what must not (the library only; no path of this build in the export).
foreach(f ${INCLUDEDIR}/capsnet/nn/capsule_linear.h
          ${INCLUDEDIR}/capsnet/nn/capsule_conv.h
          ${INCLUDEDIR}/capsnet/ops/routing.h
          ${INCLUDEDIR}/capsnet/models/capsnet.h
          ${LIBDIR}/libcapsnet.a
          ${LIBDIR}/libcapsnet_ops.so
          ${LIBDIR}/cmake/capsnet/capsnetConfig.cmake
          ${LIBDIR}/cmake/capsnet/capsnetConfigVersion.cmake
          ${LIBDIR}/cmake/capsnet/capsnetTargets.cmake)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install.find_package_consumer: step 'check installed files' failed: ${prefix}/${f} missing")
  endif()
endforeach()
file(GLOB_RECURSE installed RELATIVE ${prefix} ${prefix}/*)
foreach(f IN LISTS installed)
  if(f MATCHES "^${BINDIR}/|apps/|tests/|gtest")
    message(FATAL_ERROR "install.find_package_consumer: step 'check installed files' failed: "
                        "${f} installed (only the library belongs in the install)")
  endif()
endforeach()
file(GLOB target_files ${prefix}/${LIBDIR}/cmake/capsnet/capsnetTargets*.cmake)
foreach(f IN LISTS target_files)
  file(READ ${f} text)
  foreach(path ${BUILD_DIR} ${SOURCE_DIR})
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "install.find_package_consumer: step 'check installed files' failed: "
                          "${f} names ${path} (a path of the build tree)")
    endif()
  endforeach()
endforeach()
list(LENGTH installed n)
message(STATUS "[check installed files] ${n} files under ${prefix}")

# 3. Configure the consumer against the installed tree only (the same Torch, compiler, generator).
set(configure_args -S ${SOURCE_DIR}/tests/install/consumer -B ${consumer_build}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
if(GENERATOR)
  list(APPEND configure_args -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(Torch_DIR)
  list(APPEND configure_args -DTorch_DIR=${Torch_DIR})
endif()
step("configure the consumer" ${CMAKE_COMMAND} ${configure_args})

# 4. Build it.
step("build the consumer" ${CMAKE_COMMAND} --build ${consumer_build} --config ${BUILD_TYPE})

# 5. Run it, with no environment set up for it (the libraries are found through their RPATH).
step("run capsnet_consumer" ${consumer_build}/capsnet_consumer)
step("run capsnet_consumer_ops_loaded" ${consumer_build}/capsnet_consumer_ops_loaded)
message(STATUS "install.find_package_consumer: installed, found, built and ran")
